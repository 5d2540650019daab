"""KV events under the scheduler (tier_harness.py's fake model over simulated pools): preemption,
aborts, evictions, a CPU tier writing back and loading, reports taken every step or every few
steps; a consumer replaying them always holds exactly the hashes the cache can find."""

from __future__ import annotations

import random

import pytest
from kv_events_consumer import KvEventsConsumer
from tier_harness import ROOT, TierHarness

from spillway.protocol.hashing import block_hashes
from spillway.protocol.messages import KvEvents
from spillway.worker.core.request import RequestStatus


def run_reporting(harness: TierHarness, consumer: KvEventsConsumer, rng: random.Random | None = None) -> None:
    """Step to the end; a report after every step, or after a random one in two with `rng`."""
    for _ in range(1000):
        if not harness.scheduler.has_unfinished:
            consumer.take_from(harness.manager)
            return
        harness.step()
        if rng is None or rng.random() < 0.5:
            consumer.take_from(harness.manager)
    raise AssertionError("requests left unfinished")


def test_a_preempted_request_keeps_its_blocks_reported_until_they_are_evicted():
    harness = TierHarness(num_gpu_blocks=8, max_model_len=32, kv_events=True)
    consumer = KvEventsConsumer()
    harness.add("a", list(range(1, 9)), max_tokens=12)
    b = harness.add("b", list(range(10, 18)), max_tokens=12)
    preempted = False
    for _ in range(40):
        if not harness.scheduler.has_unfinished:
            break
        harness.step()
        consumer.take_from(harness.manager)
        preempted |= b.status == RequestStatus.PREEMPTED
    assert preempted and harness.scheduler.counts.num_preemptions == 1
    # b's prompt blocks went back to the cache at its preemption, were evicted by a's growth
    # (removed), and stored again once b recomputed them.
    assert consumer.num_removed > 0
    b_prompt = block_hashes(list(range(10, 18)), 4, ROOT)
    assert set(b_prompt) <= consumer.held


def test_an_aborted_request_leaves_its_computed_blocks_held():
    harness = TierHarness(num_gpu_blocks=16, kv_events=True)
    consumer = KvEventsConsumer()
    harness.add("a", list(range(1, 13)), max_tokens=20)
    harness.step()  # the 12-token prompt: three full blocks
    harness.step()
    assert consumer.take_from(harness.manager) == KvEvents(stored=block_hashes(list(range(1, 13)), 4, ROOT),
                                                           removed=[])
    assert [request.request_id for request in harness.scheduler.abort(["a"])] == ["a"]
    assert consumer.take_from(harness.manager) is None  # released into the cache: still findable
    assert not harness.scheduler.has_unfinished


def test_a_reset_after_a_workload_on_the_tier_clears_the_consumer():
    harness = TierHarness(num_gpu_blocks=8, num_cpu_blocks=8, max_model_len=32, kv_events=True)
    consumer = KvEventsConsumer()
    harness.add("a", list(range(1, 21)), max_tokens=2)
    run_reporting(harness, consumer)
    harness.add("b", list(range(30, 58)), max_tokens=2)  # 7 blocks: a's go to the CPU
    run_reporting(harness, consumer)
    assert harness.manager.tier.num_used > 0 and len(consumer.held) > harness.manager.num_gpu_blocks
    assert harness.manager.reset_prefix_cache()
    assert consumer.take_from(harness.manager) == KvEvents(stored=[], removed=[], cleared=True)
    assert consumer.held == set()


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("num_cpu_blocks, write_ahead_blocks, land_delay",
                         [(0, 0, 0), (2, 0, 0), (24, 0, 0), (4, 2, 2), (24, 3, 4)])
def test_a_random_workload_replays_exactly(seed, num_cpu_blocks, write_ahead_blocks, land_delay):
    """Conversations on shared prefixes in waves, a pool that preempts and evicts, a tier that
    writes back (also ahead of eviction) and loads back, aborts mid-wave; reports now and then."""
    rng = random.Random(seed)
    harness = TierHarness(num_gpu_blocks=16, num_cpu_blocks=num_cpu_blocks, max_num_seqs=4,
                          max_num_batched_tokens=16, write_ahead_blocks=write_ahead_blocks,
                          land_delay=land_delay, seed=seed, kv_events=True)
    consumer = KvEventsConsumer()
    histories = [[rng.randrange(1, 40) for _ in range(rng.randrange(4, 20))] for _ in range(4)]
    for wave in range(6):
        chosen = rng.sample(range(len(histories)), 3)
        for index in chosen:
            history = histories[index]
            if len(history) > 40:
                history[:] = history[:8]
            history += [rng.randrange(1, 40) for _ in range(rng.randrange(1, 9))]
            harness.add(f"w{wave}-c{index}", list(history), max_tokens=rng.randrange(1, 10))
        for _ in range(rng.randrange(6)):
            harness.step()
        harness.scheduler.abort([f"w{wave}-c{chosen[0]}"])
        run_reporting(harness, consumer, rng)
        for index in chosen[1:]:
            histories[index] += harness.outputs.get(f"w{wave}-c{index}", [])
    assert consumer.num_stored > 0 and consumer.num_removed > 0
    assert consumer.held == harness.manager.held_block_hashes()
