"""The router's parts without workers: the cache index (events and in-flight prompts, one walk
for every replica), each routing policy, where replicas are placed, and merged Stats."""

from __future__ import annotations

import pytest

from spillway.gateway.replicas.cache_index import CacheIndex
from spillway.gateway.replicas.merged_stats import merge_stats
from spillway.gateway.replicas.placement import place_replicas, visible_gpus
from spillway.gateway.replicas.router import Reason, Router, balance_slack
from spillway.protocol.config import WorkerConfig
from spillway.protocol.messages import KvEvents, Stats

A, B, C, D = (bytes([k]) * 16 for k in range(4))


def test_events_replayed_in_order_give_each_replicas_blocks():
    index = CacheIndex(3)
    index.apply(0, KvEvents(stored=[A, B, C], removed=[]))
    index.apply(1, KvEvents(stored=[A], removed=[]))
    index.apply(0, KvEvents(stored=[D], removed=[C]))
    assert index.matched_blocks([A, B, C, D], 0b111) == [2, 1, 0]
    index.apply(0, KvEvents(stored=[A], removed=[], cleared=True))  # reset: only A held after it
    assert index.matched_blocks([A, B], 0b111) == [1, 1, 0]
    assert index.num_held(0) == 1 and index.num_held(1) == 1


def test_prompts_in_flight_count_until_they_end_and_only_for_eligible_replicas():
    index = CacheIndex(2)
    index.route(1, [A, B])
    index.route(1, [A])
    assert index.matched_blocks([A, B, C], 0b11) == [0, 2]
    assert index.matched_blocks([A, B, C], 0b01) == [0, 0]  # replica 1 not eligible
    index.unroute(1, [A, B])
    assert index.matched_blocks([A, B], 0b11) == [0, 1]  # the other request still holds A
    index.unroute(1, [A])
    assert index.matched_blocks([A, B], 0b11) == [0, 0]


def test_forgetting_a_replica_keeps_the_others():
    index = CacheIndex(2)
    for replica in (0, 1):
        index.apply(replica, KvEvents(stored=[A, B], removed=[]))
    index.forget(0)
    assert index.matched_blocks([A, B], 0b11) == [0, 2]


def test_prefix_routing_follows_the_cache_until_the_load_gap_passes_the_blocks_saved_or_the_slack():
    router = Router("prefix", 2, max_num_seqs=8)
    assert router.slack == balance_slack(8) == 2
    router.index.apply(1, KvEvents(stored=[A, B], removed=[]))
    both = [True, True]
    assert router.choose([A, B, C], [0, 0], both) == (1, Reason.PREFIX)
    assert router.choose([A, B, C], [0, 2], both) == (1, Reason.PREFIX)  # 2 more is within the slack
    assert router.choose([A, B, C], [0, 3], both) == (0, Reason.LOAD)  # loaded: the least loaded takes it
    assert router.choose([C, D], [1, 0], both) == (1, Reason.LOAD)  # no match anywhere: least loaded
    assert router.choose([A, B], [0, 0], [True, False]) == (0, Reason.LOAD)  # the cache's replica is out


def test_the_longer_match_wins_and_equal_matches_go_to_the_less_loaded():
    router = Router("prefix", 3, max_num_seqs=64)
    router.index.apply(0, KvEvents(stored=[A], removed=[]))
    router.index.apply(1, KvEvents(stored=[A, B], removed=[]))
    router.index.apply(2, KvEvents(stored=[A, B], removed=[]))
    assert router.choose([A, B, C], [2, 5, 3], [True] * 3) == (2, Reason.PREFIX)
    # One block more than replica 0 buys one request of imbalance, not three.
    assert router.choose([A, B, C], [0, 5, 3], [True] * 3) == (0, Reason.LOAD)


def test_load_and_round_robin_spread_and_ties_take_turns():
    router = Router("load", 3, max_num_seqs=8)
    picks = [router.choose([A], [0, 0, 0], [True] * 3)[0] for _ in range(3)]
    assert sorted(picks) == [0, 1, 2]
    assert router.choose([A], [4, 1, 2], [True] * 3) == (1, Reason.LOAD)
    turns = Router("round-robin", 3, max_num_seqs=8)
    assert [turns.choose([A], [9, 0, 0], [True, False, True])[0] for _ in range(4)] == [0, 2, 0, 2]
    with pytest.raises(ValueError, match="not one of prefix, load, round-robin"):
        Router("random", 2, 8)


def test_placement_gives_each_replica_its_gpus_or_a_share_of_one():
    config = WorkerConfig(model="m", gpu_memory_utilization=0.9, tensor_parallel_size=2)
    own = place_replicas(config, 2, gpus=["0", "1", "2", "3"])
    assert [l.env["CUDA_VISIBLE_DEVICES"] for l in own.launches] == ["0,1", "2,3"] and not own.sequential
    assert all(l.config.kv_events and l.config.gpu_memory_utilization == 0.9 for l in own.launches)
    shared = place_replicas(WorkerConfig(model="m", gpu_memory_utilization=0.8), 2, gpus=["3"])
    assert shared.sequential and [l.env for l in shared.launches] == [{"CUDA_VISIBLE_DEVICES": "3"}] * 2
    assert [l.config.gpu_memory_utilization for l in shared.launches] == pytest.approx([0.4, 0.8])
    cpu = place_replicas(WorkerConfig(model="m", device="cpu"), 2, gpus=["0"], num_cores=2)
    assert [l.env for l in cpu.launches] == [{"OMP_NUM_THREADS": "1"}] * 2


def test_visible_gpus_read_cuda_visible_devices_first_then_the_driver(tmp_path):
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "2, 5"}) == ["2", "5"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []
    (tmp_path / "0000:01:00.0").mkdir()
    (tmp_path / "0000:02:00.0").mkdir()
    assert visible_gpus({}, str(tmp_path)) == ["0", "1"]
    assert visible_gpus({}, str(tmp_path / "absent")) == []


def test_merged_stats_add_counts_and_weigh_usage_by_blocks():
    merged = merge_stats([Stats(num_running=1, gpu_cache_usage=0.5, num_gpu_blocks=10, iteration_tokens=[3],
                                spec_num_accepted_tokens_per_pos=[1, 2], invariants_ok=True),
                          Stats(num_running=2, gpu_cache_usage=0.0, num_gpu_blocks=30, iteration_tokens=[4],
                                spec_num_accepted_tokens_per_pos=[5], prefix_cache_hits=7)])
    assert (merged.num_running, merged.num_gpu_blocks, merged.prefix_cache_hits) == (3, 40, 7)
    assert merged.gpu_cache_usage == pytest.approx(0.125)
    assert merged.iteration_tokens == [3, 4] and merged.spec_num_accepted_tokens_per_pos == [6, 2]
    assert merged.invariants_ok is True and merged.cpu_cache_usage == 0.0


def test_an_in_flight_prompt_counts_by_sampled_blocks_at_least_half_its_shared_prefix():
    index = CacheIndex(2)
    chain = [bytes([k]) * 16 for k in range(40, 60)]
    index.route(1, chain[:10])  # records positions 0, 1, 3, 7 and 9
    assert index.matched_blocks(chain[:12], 0b11) == [0, 8]  # the true 10, seen at position 7
    assert index.matched_blocks(chain[:10], 0b11) == [0, 10]  # the same prompt: exact
    assert index.matched_blocks(chain[:3], 0b11) == [0, 2]  # position 2 was not recorded: 2 of 3
    index.unroute(1, chain[:10])
    assert index.matched_blocks(chain[:12], 0b11) == [0, 0]


def test_a_short_shared_prefix_spreads_and_a_long_history_stays_under_imbalance():
    router = Router("prefix", 2, max_num_seqs=256)
    system = [bytes([k]) * 16 for k in range(100, 102)]  # two blocks shared by every chat
    router.index.apply(0, KvEvents(stored=system, removed=[]))
    new_chat = system + [bytes([200]) * 16]
    assert router.choose(new_chat, [2, 0], [True, True]) == (0, Reason.PREFIX)
    assert router.choose(new_chat, [3, 0], [True, True]) == (1, Reason.LOAD)  # 3 ahead, 2 blocks saved
    history = system + [bytes([k]) * 16 for k in range(110, 150)]  # a 42-block conversation on replica 0
    router.index.apply(0, KvEvents(stored=history, removed=[]))
    router.index.apply(1, KvEvents(stored=system, removed=[]))
    assert router.choose(history + [bytes([201]) * 16], [30, 0], [True, True]) == (0, Reason.PREFIX)
    assert router.choose(history + [bytes([201]) * 16], [70, 0], [True, True]) == (1, Reason.LOAD)  # past the slack (64)
