"""The scheduler giving blocks back: preemption when the pool runs out, aborts, deferred release."""

from __future__ import annotations

import random

import pytest
from tests.worker.core.test_scheduler import Harness, chunks, expected_outputs

from spillway.protocol.messages import FinishReason
from spillway.worker.core.request import RequestStatus


def test_running_out_of_blocks_preempts_the_newest_which_resumes_and_completes():
    harness = Harness(num_blocks=8, max_model_len=32)
    harness.add("a", list(range(8)), max_tokens=12)
    b = harness.add("b", list(range(10, 18)), max_tokens=12)
    for _ in range(9):
        harness.step()
        assert harness.scheduler.counts.num_preemptions == 0
    plan, _ = harness.step()  # a's tokens reach block 5: no block left
    assert harness.scheduler.waiting == [b] and [c[0] for c in chunks(plan)] == ["a"]
    assert chunks(plan)[0][3] == [0, 1, 4, 6, 7]  # 7 was b's last block, the LRU head
    assert (b.status, b.num_computed_tokens, b.num_preemptions) == (RequestStatus.PREEMPTED, 0, 1)
    assert harness.scheduler.counts.num_preemptions == 1 and harness.scheduler.waiting == [b]
    assert len(harness.results["b"]) == 9
    harness.step()
    plan, results = harness.step()  # a finishes; b waits until it has
    assert [c[0] for c in chunks(plan)] == ["a"] and results[0].finish_reason == FinishReason.LENGTH
    plan, results = harness.step()
    # b recomputes prompt + 9 outputs, with its own first three blocks still cached.
    assert chunks(plan) == [("b", 12, 5, [2, 3, 5, 7, 6], True)]
    assert results[0].num_cached_tokens == -1
    assert (harness.scheduler.counts.prefix_cache_queries, harness.scheduler.counts.prefix_cache_hits) == (16, 0)
    harness.run()
    for request_id, prompt_len in (("a", 8), ("b", 8)):
        outputs = [t for r in harness.results[request_id] for t in r.new_token_ids]
        assert outputs == expected_outputs(prompt_len, 12)
    assert harness.manager.num_free_blocks == 8


def test_the_request_needing_a_block_is_preempted_when_it_is_the_newest():
    harness = Harness(num_blocks=5, max_model_len=20)
    harness.add("a", list(range(8)))
    b = harness.add("b", list(range(6)))
    for _ in range(3):
        harness.step()
        assert harness.scheduler.counts.num_preemptions == 0
    plan, _ = harness.step()  # b's 9th token needs a third block; a holds the last free one
    assert harness.scheduler.waiting == [b] and harness.scheduler.counts.num_preemptions == 1
    assert chunks(plan) == [("a", 10, 1, [0, 1, 4], True)]
    assert b.status == RequestStatus.PREEMPTED and b.num_output_tokens == 3


def test_abort_frees_blocks_at_once_and_skips_unknown_ids():
    harness = Harness(num_blocks=8, max_num_seqs=1, max_model_len=32)
    a = harness.add("a", list(range(10)))
    b = harness.add("b", [1, 2, 3])
    harness.step()
    assert harness.manager.num_free_blocks == 5
    assert harness.scheduler.abort(["a", "nope", "b"]) == [a, b]
    assert a.status == b.status == RequestStatus.FINISHED_ABORTED
    assert a.finish_reason == FinishReason.ABORT
    assert harness.manager.num_free_blocks == 8
    assert not harness.scheduler.has_unfinished and not harness.scheduler.has_request("a")
    assert harness.scheduler.num_running == harness.scheduler.num_waiting == 0
    assert harness.scheduler.abort(["a"]) == []
    harness.manager.check_invariants()


def test_abort_between_schedule_and_update_drops_the_chunk():
    harness = Harness()
    harness.add("a", list(range(10)))
    harness.add("b", list(range(5)))
    plan = harness.scheduler.schedule()
    harness.scheduler.abort(["a"])
    results = harness.scheduler.update(plan, {"a": 1, "b": 2})
    assert [(r.request.request_id, r.new_token_ids) for r in results] == [("b", [2])]
    assert harness.manager.slot_table("a") == []
    harness.manager.check_invariants()


def test_a_deferred_release_frees_the_blocks_after_the_results_or_at_the_next_schedule():
    harness = Harness(num_blocks=8, max_model_len=32, defer_release=True)
    harness.add("a", list(range(10)), max_tokens=1)
    _, results = harness.step()
    assert [(r.request.request_id, r.finish_reason) for r in results] == [("a", FinishReason.LENGTH)]
    assert not harness.scheduler.has_unfinished and not harness.scheduler.has_request("a")
    assert harness.manager.num_free_blocks == 5  # still held: the deltas go out first
    assert harness.scheduler.abort(["a"]) == []  # finished: nothing to abort
    harness.scheduler.release_finished()
    assert harness.manager.num_free_blocks == 8
    harness.scheduler.release_finished()  # nothing left: a no-op
    assert harness.manager.num_free_blocks == 8
    # Not released by the caller: the next schedule frees them first; an id finished but not
    # yet released can be used again.
    harness.add("b", list(range(10)), max_tokens=1)
    harness.step()
    assert harness.manager.num_free_blocks == 5
    harness.add("b", list(range(10, 20)), max_tokens=1)
    assert harness.manager.num_free_blocks == 8
    harness.run()
    assert harness.manager.num_free_blocks == 5
    harness.scheduler.release_finished()
    assert harness.manager.num_free_blocks == 8
    harness.manager.check_invariants()


@pytest.mark.parametrize("defer_release", [False, True], ids=["release-at-once", "deferred-release"])
@pytest.mark.parametrize("seed", range(4))
def test_a_random_workload_under_block_pressure_produces_every_expected_token(seed, defer_release):
    rng = random.Random(seed)
    harness = Harness(num_blocks=12, max_num_seqs=4, max_num_batched_tokens=12, max_model_len=40,
                      defer_release=defer_release)
    prefixes = [[rng.randrange(50) for _ in range(n)] for n in (0, 5, 9)]
    expected = {}
    for step in range(200):
        if step < 60 and rng.random() < 0.3:
            prompt = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randint(1, 14))]
            max_tokens = rng.randint(1, 20)
            request_id = f"r{step}"
            harness.add(request_id, prompt, max_tokens=max_tokens)
            num_outputs = min(max_tokens, 40 - len(prompt))
            expected[request_id] = expected_outputs(len(prompt), num_outputs)
        harness.step()
    harness.run()
    outputs = {i: [t for r in results for t in r.new_token_ids] for i, results in harness.results.items()}
    assert outputs == expected
    assert harness.scheduler.counts.num_preemptions > 0
    harness.scheduler.release_finished()
    assert harness.manager.num_free_blocks == 12


def _position_token(chunk) -> int:
    """fake_token of the sequence the chunk ends (known before the pending token is)."""
    return (chunk.start + chunk.num_tokens) % 7 + 100


def _run_ahead(harness: Harness) -> list:
    """Step as asynchronous scheduling does: each plan made while the one before is in flight
    (its tokens pending), that one committed after. Returns the plans made ahead."""
    scheduler, in_flight, ahead_plans = harness.scheduler, None, []
    for _ in range(500):
        if not scheduler.has_unfinished and in_flight is None:
            return ahead_plans
        plan = scheduler.schedule(ahead=in_flight is not None)
        if in_flight is not None:
            ahead_plans.append((plan, [r for r in scheduler.running if r.num_output_tokens + 1 < r.params.max_tokens]))
            for result in scheduler.update(*in_flight):
                harness.results.setdefault(result.request.request_id, []).append(result)
            harness.manager.check_invariants()
        in_flight = None
        if plan.chunks:
            scheduler.mark_in_flight(plan)
            in_flight = (plan, {c.request.request_id: _position_token(c) for c in plan.chunks if c.sample})
    raise AssertionError("requests did not finish")


def test_a_step_planned_ahead_preempts_instead_of_stopping_short():
    """Planned while the step before is in flight, a step short of blocks preempts the newest
    request as any step does: every other running request still gets its token (stopping
    short, the step would leave out everyone after the request that found no block). The
    victim's token in flight is committed with its step, and it resumes after."""
    harness = Harness(num_blocks=12, max_model_len=40)
    for i in range(4):
        harness.add(f"r{i}", list(range(10 * i, 10 * i + 6)), max_tokens=14)
    ahead_plans = _run_ahead(harness)
    assert harness.scheduler.counts.num_preemptions > 0
    for plan, running in ahead_plans:
        # Each request still running after the plan (and not about to end) is in it.
        planned = {chunk.request.request_id for chunk in plan.chunks}
        assert {r.request_id for r in running} <= planned
    for i in range(4):
        outputs = [t for r in harness.results[f"r{i}"] for t in r.new_token_ids]
        assert outputs == expected_outputs(6, 14)
    assert harness.manager.num_free_blocks == 12


def test_a_request_preempted_with_its_last_token_in_flight_finishes_from_the_waiting_queue():
    harness = Harness(num_blocks=3, max_model_len=12)
    a = harness.add("a", list(range(7)), max_tokens=8)
    b = harness.add("b", list(range(3)), max_tokens=2)
    scheduler = harness.scheduler
    scheduler.update(scheduler.schedule(), {"a": 100, "b": 101})
    in_flight = scheduler.schedule()  # b's second token, its last
    scheduler.mark_in_flight(in_flight)
    plan = scheduler.schedule(ahead=True)  # a's next position needs a block: b goes
    assert [c[0] for c in chunks(plan)] == ["a"] and scheduler.counts.num_preemptions == 1
    assert b.status == RequestStatus.PREEMPTED and b.num_pending_tokens == 1 and scheduler.waiting == [b]
    results = scheduler.update(in_flight, {"a": 102, "b": 103})
    assert [(r.request.request_id, r.new_token_ids, r.finish_reason) for r in results] == [
        ("a", [102], None), ("b", [103], FinishReason.LENGTH)]
    assert b.output_token_ids == [101, 103] and scheduler.waiting == [] and not scheduler.has_request("b")
    assert harness.manager.slot_table("b") == []
    harness.manager.check_invariants()


def test_a_preempted_request_waits_for_its_token_in_flight_before_it_is_admitted_again():
    harness = Harness(num_blocks=3, max_model_len=12)
    harness.add("a", list(range(7)), max_tokens=8)
    b = harness.add("b", list(range(3)), max_tokens=4)
    scheduler = harness.scheduler
    scheduler.update(scheduler.schedule(), {"a": 100, "b": 101})
    in_flight = scheduler.schedule()
    scheduler.mark_in_flight(in_flight)
    plan = scheduler.schedule(ahead=True)
    assert b.status == RequestStatus.PREEMPTED and b.num_pending_tokens == 1
    scheduler.abort(["a"])  # every block free again, b still owes a token
    assert scheduler.schedule(ahead=True).chunks == []
    del plan
    scheduler.update(in_flight, {"b": 103})
    assert b.output_token_ids == [101, 103] and b.num_pending_tokens == 0
    assert [c[:3] for c in chunks(scheduler.schedule())] == [("b", 0, 5)]  # prompt and both outputs, anew
