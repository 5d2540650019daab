"""The scheduler with a CPU tier, over the two simulated pools of tier_harness.py: every step
checks the KV each chunk reads, and the block manager's invariants."""

from __future__ import annotations

import random

import pytest
from tier_harness import TierHarness

from spillway.worker.core.request import RequestStatus

TURN_1 = list(range(1, 21))  # 20 tokens: 5 blocks of 4
FILLER = list(range(200, 263))  # 63 tokens: 16 blocks, the whole GPU pool


def two_turns(num_cpu_blocks: int, write_ahead_blocks: int = 0) -> TierHarness:
    """A conversation whose first turn the filler pushes out of the GPU pool."""
    harness = TierHarness(num_gpu_blocks=16, num_cpu_blocks=num_cpu_blocks, write_ahead_blocks=write_ahead_blocks)
    harness.add("turn-1", TURN_1, max_tokens=4)
    harness.run()
    harness.add("filler", FILLER, max_tokens=1)
    harness.run()
    harness.add("turn-2", TURN_1 + harness.outputs["turn-1"] + list(range(30, 38)), max_tokens=4)
    return harness


def test_a_second_turn_past_the_gpu_pool_loads_its_history_and_recomputes_only_the_rest():
    harness = two_turns(num_cpu_blocks=32)
    plan, _ = harness.step()
    # 5 history blocks (turn 1's prompt; its outputs never filled a computed block) come from
    # the CPU; the request starts a step later, when they have landed. Its 8 blocks take the
    # filler's free slot and evict 7 cached filler blocks, written back first.
    assert plan.chunks == []
    assert len(plan.kv_copies.cpu_to_gpu) == 5
    assert len(plan.kv_copies.gpu_to_cpu) == 7
    plan, _ = harness.step()
    assert [(chunk.start, chunk.num_tokens) for chunk in plan.chunks] == [(20, 12)]
    harness.run()
    assert harness.cached["turn-2"] == 20
    assert harness.computed["turn-2"] == 12 + 3  # the new prompt tokens, then 3 decodes
    scheduler = harness.scheduler
    assert (scheduler.counts.cached_tokens_gpu, scheduler.counts.cached_tokens_cpu) == (0, 20)
    assert (scheduler.counts.prefix_cache_queries, scheduler.counts.prefix_cache_hits) == (20 + 63 + 32, 20)
    assert (scheduler.counts.cpu_cache_queries, scheduler.counts.cpu_cache_hits) == (20 + 63 + 32, 20)

    without = two_turns(num_cpu_blocks=0)
    without.run()
    assert without.outputs == harness.outputs
    assert without.cached["turn-2"] == 0 and without.computed["turn-2"] == 32 + 3
    assert without.scheduler.counts.cpu_cache_queries == 0


def test_requests_on_blocks_still_landing_wait_without_holding_up_others_or_the_host():
    """A load planned in one step may still be on its way steps later (a 10k-token prefix is
    ~1.5 GB of copies): the requests on it stay out of the plans, so the host never waits for
    the copy, requests arriving meanwhile that need the same blocks wait with them, others
    run; once the engine says the loads landed, all of them compute in one step."""
    harness = two_turns(num_cpu_blocks=32)
    steps = []
    harness.hold_loads = True  # the device has not finished the loads yet
    plan, _ = harness.step()
    assert plan.chunks == [] and len(plan.kv_copies.cpu_to_gpu) == 5
    history = TURN_1 + harness.outputs["turn-1"]
    harness.add("same-prefix", history + [40, 41], max_tokens=2)
    harness.add("other", list(range(100, 110)), max_tokens=3)
    for _ in range(3):
        plan, _ = harness.step()
        steps.append(sorted(chunk.request.request_id for chunk in plan.chunks))
    assert steps == [["other"], ["other"], ["other"]]
    assert not plan.kv_copies.cpu_to_gpu  # the second request shares the load on its way
    assert harness.scheduler.num_awaiting_load == 2
    harness.hold_loads = False  # the loads have landed
    plan, _ = harness.step()
    assert sorted(chunk.request.request_id for chunk in plan.chunks) == ["same-prefix", "turn-2"]
    assert harness.scheduler.num_awaiting_load == 0
    harness.run()
    assert harness.cached["turn-2"] == 20 and harness.cached["same-prefix"] == 20


def test_an_abort_while_its_blocks_load_leaves_them_cached_for_the_next_request():
    harness = two_turns(num_cpu_blocks=32)
    prompt = harness.scheduler.waiting[0].prompt_token_ids
    plan, _ = harness.step()
    assert len(plan.kv_copies.cpu_to_gpu) == 5
    assert [request.request_id for request in harness.scheduler.abort(["turn-2"])] == ["turn-2"]
    harness.manager.check_invariants()
    harness.add("again", prompt, max_tokens=4)
    plan, _ = harness.step()
    assert plan.kv_copies.cpu_to_gpu == ()  # loaded by the aborted request's step
    assert [(chunk.start, chunk.num_tokens) for chunk in plan.chunks] == [(20, 12)]
    harness.run()
    assert harness.cached["again"] == 20
    assert harness.scheduler.counts.cached_tokens_gpu == 20
    without = two_turns(num_cpu_blocks=0)
    without.run()
    assert harness.outputs["again"] == without.outputs["turn-2"]


def preempted_while_loading(num_cpu_blocks: int) -> TierHarness:
    harness = TierHarness(num_gpu_blocks=16, num_cpu_blocks=num_cpu_blocks)
    harness.add("turn-1", TURN_1, max_tokens=1)
    harness.run()
    harness.add("filler", FILLER, max_tokens=1)
    harness.run()
    harness.add("long-1", list(range(300, 311)), max_tokens=30)  # 11 tokens: a new block at 12
    harness.add("long-2", list(range(400, 411)), max_tokens=30)
    harness.step()
    harness.add("turn-2", TURN_1 + list(range(30, 46)), max_tokens=4)  # 9 blocks, 5 of them loaded
    return harness


def test_a_request_preempted_before_its_loads_were_used_resumes_from_them():
    harness = preempted_while_loading(num_cpu_blocks=32)
    plan, _ = harness.step()
    assert [chunk.request.request_id for chunk in plan.chunks] == ["long-1", "long-2"]
    assert len(plan.kv_copies.cpu_to_gpu) == 5
    turn_2 = harness.scheduler.running[-1]
    assert turn_2.request_id == "turn-2"
    # The long requests each need a block next step and one is left: the newest goes.
    plan, _ = harness.step()
    assert turn_2.status == RequestStatus.PREEMPTED and "turn-2" not in harness.computed
    assert [chunk.request.request_id for chunk in plan.chunks] == ["long-1", "long-2"]
    harness.run()
    assert harness.cached["turn-2"] == 20  # counted once, at its first admission
    assert harness.scheduler.counts.cached_tokens_cpu == 20
    without = preempted_while_loading(num_cpu_blocks=0)
    without.run()
    assert without.outputs == harness.outputs


def random_workload(seed: int, num_cpu_blocks: int, write_ahead_blocks: int = 0, land_delay: int = 0,
                    plan_before_landing: bool = False, check_serves: bool = False) -> TierHarness:
    """Conversations that share prefixes, in waves, on a pool that preempts often
    (`check_serves`: TierHarness's)."""
    rng = random.Random(seed)
    harness = TierHarness(num_gpu_blocks=16, num_cpu_blocks=num_cpu_blocks, max_num_seqs=4,
                          max_num_batched_tokens=16, write_ahead_blocks=write_ahead_blocks,
                          land_delay=land_delay, seed=seed)
    harness.plan_before_landing = plan_before_landing
    harness.check_serves = check_serves
    histories = [[rng.randrange(1, 40) for _ in range(rng.randrange(4, 20))] for _ in range(4)]
    for wave in range(6):
        # Each wave runs to its end, so the next one's histories do not depend on timing.
        chosen = rng.sample(range(len(histories)), 3)
        for index in chosen:
            history = histories[index]
            if len(history) > 40:
                history[:] = history[:8]
            history += [rng.randrange(1, 40) for _ in range(rng.randrange(1, 9))]
            harness.add(f"w{wave}-c{index}", list(history), max_tokens=rng.randrange(1, 10), seed=rng.randrange(3))
        harness.run()
        for index in chosen:
            histories[index] += harness.outputs[f"w{wave}-c{index}"]
    return harness


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("num_cpu_blocks, write_ahead_blocks, land_delay, before_landing",
                         [(2, 0, 0, False), (24, 0, 0, False), (2, 2, 0, False), (24, 3, 0, False),
                          (24, 0, 3, False), (4, 2, 2, False), (24, 3, 4, False), (24, 0, 3, True),
                          (4, 2, 2, True), (24, 3, 4, True)])
def test_outputs_are_the_same_with_and_without_the_tier_under_memory_pressure(seed, num_cpu_blocks,
                                                                               write_ahead_blocks, land_delay,
                                                                               before_landing):
    """`land_delay`: each step's loads land 0..land_delay steps late, on their own;
    `before_landing`: requests waiting for loads are planned once nothing else runs, the step
    waiting for the loads."""
    with_tier = random_workload(seed, num_cpu_blocks, write_ahead_blocks, land_delay, before_landing)
    without = random_workload(seed, 0)
    assert with_tier.outputs == without.outputs
    assert sum(with_tier.computed.values()) <= sum(without.computed.values())
    assert with_tier.scheduler.counts.num_preemptions + without.scheduler.counts.num_preemptions > 0
    stores = [len(plan.kv_copies.gpu_to_cpu + plan.kv_copies.ahead_to_cpu) for plan in with_tier.plans]
    assert sum(stores) > 0


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("num_cpu_blocks, write_ahead_blocks, land_delay", [(2, 0, 0), (24, 0, 2), (4, 2, 2),
                                                                             (24, 3, 4)])
def test_a_producer_serving_between_steps_reads_only_blocks_whose_bytes_are_there(seed, num_cpu_blocks,
                                                                                  write_ahead_blocks, land_delay):
    """After every step of the random workload, each request's blocks that `readable_prefix`
    names hold their own tokens in the pool named: never a CPU copy whose store (at eviction
    or ahead of it, which runs late here) has not run, nor a GPU slot a load still fills."""
    harness = random_workload(seed, num_cpu_blocks, write_ahead_blocks, land_delay, check_serves=True)
    assert harness.served["cpu"] > 0 and harness.served["gpu"] > 0


def history_then_chat(num_cpu_blocks: int, write_ahead_blocks: int = 0) -> TierHarness:
    """Turn 1 pushed out by the filler, then a short chat decodes a while (the steps the
    write-back ahead of eviction works in), then turn 2 comes."""
    harness = TierHarness(num_gpu_blocks=16, num_cpu_blocks=num_cpu_blocks, write_ahead_blocks=write_ahead_blocks)
    harness.add("turn-1", TURN_1, max_tokens=4)
    harness.run()
    harness.add("filler", FILLER[:55], max_tokens=1)
    harness.run()
    harness.add("chat", [300, 301], max_tokens=8)
    harness.run()
    harness.add("turn-2", TURN_1 + harness.outputs["turn-1"] + list(range(30, 38)), max_tokens=4)
    return harness


def test_history_written_back_ahead_loads_without_a_store_in_its_way():
    """The filler's blocks get CPU copies while the chat decodes, so the step that loads turn
    1's history into their slots has no store to wait for; outputs stay the same."""
    ahead = history_then_chat(num_cpu_blocks=64, write_ahead_blocks=4)
    plan, _ = ahead.step()
    assert len(plan.kv_copies.cpu_to_gpu) == 5 and plan.kv_copies.gpu_to_cpu == ()
    ahead.run()
    assert sum(len(p.kv_copies.ahead_to_cpu) for p in ahead.plans) > 0
    behind = history_then_chat(num_cpu_blocks=64)
    plan, _ = behind.step()
    assert len(plan.kv_copies.cpu_to_gpu) == 5 and len(plan.kv_copies.gpu_to_cpu) > 0
    behind.run()
    without = history_then_chat(num_cpu_blocks=0)
    without.run()
    assert ahead.outputs == behind.outputs == without.outputs and ahead.cached["turn-2"] == 20


def test_the_random_workload_loads_from_the_tier_and_saves_compute():
    harnesses = [(random_workload(seed, 24), random_workload(seed, 0)) for seed in range(8)]
    assert sum(with_tier.scheduler.counts.cached_tokens_cpu for with_tier, _ in harnesses) > 0
    assert sum(sum(w.computed.values()) for w, _ in harnesses) < sum(sum(n.computed.values()) for _, n in harnesses)


def two_histories_on_the_cpu() -> TierHarness:
    """Two conversations' first turns (two blocks each), pushed out to the CPU tier by a
    filler; loads land only when the test says so."""
    harness = TierHarness(num_gpu_blocks=16, num_cpu_blocks=32)
    harness.add("a-1", TURN_1[:8], max_tokens=1)
    harness.add("b-1", list(range(50, 58)), max_tokens=1)
    harness.run()
    harness.add("filler", FILLER, max_tokens=1)
    harness.run()
    harness.hold_loads = True
    return harness


def test_a_burst_member_arriving_as_its_step_is_planned_before_the_landing_joins_it():
    """a-2 waits for batch 1; as its step is planned before the landing, a-late arrives on the
    same history (the same loads) and joins the step, while b-2, whose history loads in a batch
    of its own planned now, waits for it: the step would otherwise wait for b's loads too."""
    harness = two_histories_on_the_cpu()
    harness.add("a-2", TURN_1[:8] + [70, 71], max_tokens=2)
    plan, _ = harness.step()
    assert plan.kv_copies.load_batch == 1 and harness.scheduler.num_awaiting_load == 1
    harness.add("a-late", TURN_1[:8] + [72, 73], max_tokens=2)
    harness.add("b-2", list(range(50, 58)) + [80, 81], max_tokens=2)
    harness.plan_before_landing = True
    plan, _ = harness.step()
    assert [chunk.request.request_id for chunk in plan.chunks] == ["a-2", "a-late"]
    assert plan.kv_copies.wait_for_loads and plan.kv_copies.wait_by_layer
    assert plan.kv_copies.load_batch == 2 and len(plan.kv_copies.cpu_to_gpu) == 2  # b's history
    assert harness.scheduler.num_awaiting_load == 1 and harness.scheduler.first_awaited_load == 2
    harness.hold_loads = False
    harness.run()  # every step's KV reads are checked
    assert {name: len(harness.outputs[name]) for name in ("a-2", "a-late", "b-2")} == {"a-2": 2, "a-late": 2, "b-2": 2}
    harness.manager.check_invariants()


def test_requests_waiting_for_loads_planned_before_the_landing_wait_for_the_loads_in_their_step():
    """Nothing else runs: the requests on blocks still landing are planned anyway, their step
    waits for every load queued (the harness applies them first, as the device orders them);
    their CPU copies stay held until the landing is reported."""
    harness = two_turns(num_cpu_blocks=32)
    harness.hold_loads = True
    plan, _ = harness.step()  # admitted; its loads planned
    assert plan.chunks == [] and not plan.kv_copies.wait_for_loads
    harness.add("same-prefix", TURN_1 + harness.outputs["turn-1"] + [40, 41], max_tokens=2)
    plan, _ = harness.step()  # admitted on the same loads, without a chunk
    assert plan.chunks == [] and harness.scheduler.num_awaiting_load == 2
    harness.plan_before_landing = True
    plan, _ = harness.step()
    assert sorted(chunk.request.request_id for chunk in plan.chunks) == ["same-prefix", "turn-2"]
    assert plan.kv_copies.wait_for_loads and not plan.kv_copies.cpu_to_gpu
    assert harness.scheduler.num_awaiting_load == 0
    assert harness.manager.tier.num_loading == 5  # not reported landed yet: their copies are held
    harness.run()  # every step's KV reads are checked
    assert harness.manager.tier.num_loading == 5
    harness.hold_loads = False
    harness.step()
    assert harness.manager.tier.num_loading == 0
    harness.manager.check_invariants()
    without = two_turns(num_cpu_blocks=0)
    without.add("same-prefix", TURN_1 + without.outputs["turn-1"] + [40, 41], max_tokens=2)
    without.run()
    assert harness.outputs == without.outputs
    assert harness.cached["turn-2"] == harness.cached["same-prefix"] == 20


def test_a_request_computes_once_its_own_loads_landed_not_those_planned_after():
    """Two conversations' histories load in two steps' batches; the first batch lands while
    the second is still on its way: the first request computes alone, the second after."""
    harness = two_histories_on_the_cpu()
    harness.add("a-2", TURN_1[:8] + [70, 71], max_tokens=2)
    plan, _ = harness.step()
    harness.add("b-2", list(range(50, 58)) + [80, 81], max_tokens=2)
    plan_b, _ = harness.step()
    assert plan.kv_copies.load_batch == 1 and plan_b.kv_copies.load_batch == 2
    assert harness.scheduler.num_awaiting_load == 2
    assert harness.scheduler.first_awaited_load == 1  # what the busy loop asks the copier about
    harness._apply_loads(1)  # batch 1 landed; the engine hears of it
    harness.scheduler.loads_landed(1)
    assert harness.scheduler.first_awaited_load == 2
    plan, _ = harness.step()
    assert [chunk.request.request_id for chunk in plan.chunks] == ["a-2"]
    assert harness.scheduler.num_awaiting_load == 1
    harness.hold_loads = False
    harness.run()
    assert harness.cached["a-2"] == harness.cached["b-2"] == 8
    assert harness.scheduler.first_awaited_load is None


def test_two_requests_admitted_in_one_step_load_in_batches_of_their_own():
    """Two conversations' next turns arrive together: one step plans both histories' loads,
    each request's as a batch of its own. The first batch lands while the second is still on
    its way: the first turn computes alone, the second once its batch is in."""
    harness = two_histories_on_the_cpu()
    harness.add("a-2", TURN_1[:8] + [70, 71], max_tokens=2)
    harness.add("b-2", list(range(50, 58)) + [80, 81], max_tokens=2)
    plan, _ = harness.step()
    copies = plan.kv_copies
    assert not plan.chunks and len(copies.cpu_to_gpu) == 4  # two blocks each, none computes yet
    assert copies.load_batch_ends == ((1, 2), (2, 4)) and copies.load_batch == 2
    assert harness.scheduler.first_awaited_load == 1
    harness._apply_loads(1)
    harness.scheduler.loads_landed(1)
    plan, _ = harness.step()
    assert [chunk.request.request_id for chunk in plan.chunks] == ["a-2"]
    harness.hold_loads = False
    harness.run()
    assert harness.cached["a-2"] == harness.cached["b-2"] == 8
    assert len(harness.outputs["a-2"]) == len(harness.outputs["b-2"]) == 2
