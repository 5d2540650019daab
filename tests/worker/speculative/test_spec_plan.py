"""Speculation's parts without a model: draft slots in the plan, the verified rows the executor
returns, runs committed through Scheduler.update (only committed tokens computed and hashed),
the switch's rule, the n-gram lookup and the replay."""

from __future__ import annotations

import pytest

from spillway.protocol.hashing import block_hashes
from spillway.protocol.messages import FinishReason
from spillway.worker.driver.pipeline import pack_step
from spillway.worker.speculative.proposer import NgramProposer, ReplayProposer, ngram_lookup
from spillway.worker.speculative.switch import SpeculationSwitch

from tests.worker.driver.test_step_pipeline import BLOCK, ROOT, make_request, make_scheduler, prefill_then_plan


def test_decodes_get_draft_slots_cut_by_max_tokens_and_max_model_len():
    scheduler = make_scheduler(max_model_len=12)
    roomy = make_request("roomy", [1, 2, 3], 0, max_tokens=8)
    short = make_request("short", [4, 5, 6], 1, max_tokens=3)  # 1 output so far: 2 more, so 1 draft
    edge = make_request("edge", list(range(10, 19)), 2, max_tokens=8)  # 10 tokens of 12: 1 draft
    prefill_then_plan(scheduler, roomy, short, edge)
    plan = scheduler.schedule(lookahead=4)
    assert [(c.request.request_id, c.num_tokens, c.num_draft_slots) for c in plan.chunks] == [
        ("roomy", 1, 4), ("short", 1, 1), ("edge", 1, 1)]
    assert plan.num_batched_tokens == 3 + 4 + 1 + 1
    # The slot tables cover the drafts: roomy holds 4 + 4 tokens in 2 blocks of 4.
    assert len(plan.chunks[0].slot_table) == 2 and len(plan.chunks[2].slot_table) == 3


def test_draft_slots_never_preempt_and_fit_the_token_budget():
    scheduler = make_scheduler(num_blocks=3, max_model_len=12)
    scheduler.max_num_batched_tokens = 4
    request = make_request("a", [1, 2, 3], max_tokens=20)
    plan = prefill_then_plan(scheduler, request)
    assert plan.chunks[0].num_draft_slots == 0  # no lookahead asked
    plan = scheduler.schedule(lookahead=8)  # 4 tokens of budget: 1 decode + 3 drafts
    assert plan.chunks[0].num_draft_slots == 3
    other = make_scheduler(num_blocks=3, max_model_len=12)
    requests = [make_request("x", [1, 2, 3, 4, 5, 6, 7], 0), make_request("y", [8, 9, 10], 1)]
    prefill_then_plan(other, *requests)  # x: 8 tokens in 2 blocks, y: 4 in 1: the pool is full
    plan = other.schedule(lookahead=3)
    assert [(c.num_tokens, c.num_draft_slots) for c in plan.chunks] == [(1, 0), (1, 0)]
    assert other.counts.num_preemptions == 0


def test_drafts_take_only_the_blocks_no_running_request_needs():
    scheduler = make_scheduler(num_blocks=4, max_model_len=16)
    older, newer = make_request("older", [1, 2, 3], 0), make_request("newer", list(range(10, 18)), 1)
    scheduler.add(older)
    scheduler.add(newer)
    prefill = scheduler.schedule()
    scheduler.update(prefill, {"older": 7, "newer": 7})  # older: 4 tokens in 1 block; newer: 9 in 2 so far
    assert scheduler.block_manager.num_free_blocks == 1
    plan = scheduler.schedule(lookahead=4)  # newer's decode takes the last free block, not older's drafts
    assert [(c.request.request_id, c.num_draft_slots) for c in plan.chunks] == [("older", 0), ("newer", 0)]
    assert scheduler.counts.num_preemptions == 0 and scheduler.block_manager.num_free_blocks == 0


def test_pack_step_asks_for_every_verified_row():
    scheduler = make_scheduler()
    a, b, c = make_request("a", [1, 2, 3], 0), make_request("b", [4, 5], 1), make_request("c", [6, 7, 8], 2)
    prefill_then_plan(scheduler, a, b, c)  # each sampled 7
    plan = scheduler.schedule(lookahead=3)
    plan.chunks[0].draft_token_ids = (9, 9, 9)
    plan.chunks[2].draft_token_ids = (8,)
    packed = pack_step(plan, None)
    assert [chunk.token_ids for chunk in packed.chunks] == [[7, 9, 9, 9], [7], [7, 8]]
    assert packed.logits_rows == [0, 1, 2, 3, 4, 5, 6]
    assert pack_step(scheduler.schedule(), None).logits_rows == []


def test_a_run_commits_the_accepted_drafts_and_hashes_only_committed_blocks():
    scheduler = make_scheduler()
    request = make_request("a", [1, 2, 3], max_tokens=20)
    prefill_then_plan(scheduler, request)  # [1, 2, 3, 7]: 3 computed
    plan = scheduler.schedule(lookahead=4)
    plan.chunks[0].draft_token_ids = (20, 21, 22, 23)
    results = scheduler.update(plan, {"a": 30}, {"a": [20, 21]})  # 22 rejected, 30 recovered
    assert [(r.new_token_ids, r.finish_reason) for r in results] == [([20, 21, 30], None)]
    assert request.all_token_ids == [1, 2, 3, 7, 20, 21, 30]
    assert request.num_computed_tokens == 6  # 7, 20, 21 computed here; the rejected 22, 23 never count
    manager = scheduler.block_manager
    expected = block_hashes(request.all_token_ids, BLOCK, ROOT)
    assert len(expected) == 1 and manager.blocks[manager.slot_table("a")[0]].block_hash == expected[0]
    assert manager.blocks[manager.slot_table("a")[1]].block_hash is None


@pytest.mark.parametrize("params, accepted, sampled, expected_tokens, reason", [
    ({"stop_token_ids": [21]}, [20, 21, 22], 40, [20, 21], FinishReason.STOP),
    ({"max_tokens": 3}, [20, 21, 22], 40, [20, 21], FinishReason.LENGTH),
    ({"ignore_eos": False, "min_tokens": 3}, [999, 20], 999, [999, 20, 999], FinishReason.STOP),
])
def test_a_run_stops_at_the_first_token_that_finishes_it(params, accepted, sampled, expected_tokens, reason):
    scheduler = make_scheduler()
    request = make_request("a", [1, 2, 3], **{"max_tokens": 20, **params})
    prefill_then_plan(scheduler, request)  # one output: 7
    plan = scheduler.schedule(lookahead=4)
    plan.chunks[0].draft_token_ids = tuple(accepted)
    results = scheduler.update(plan, {"a": sampled}, {"a": accepted})
    assert [(r.new_token_ids, r.finish_reason) for r in results] == [(expected_tokens, reason)]
    assert not scheduler.has_request("a") and scheduler.block_manager.num_free_blocks == 32


def test_the_switch_turns_speculation_off_for_large_batches_and_losing_acceptance():
    switch = SpeculationSwitch(4, max_batch_size=8, draft_cost=0.1, verify_cost=0.05, acceptance=0.5,
                               smoothing=1.0, probe_interval=3)
    assert switch.lookahead(8) == 4 and switch.lookahead(9) == 0
    switch.observe(num_slots=40, num_accepted_tokens=4)  # 0.1 < 0.15: a loss
    assert switch.gain() == pytest.approx(1.4 / 1.6)
    answers = []
    for _ in range(9):
        answers.append(switch.lookahead(1))
        if answers[-1]:
            switch.observe(num_slots=4, num_accepted_tokens=0)  # the probe still loses
    assert answers == [0, 0, 4, 0, 0, 0, 0, 0, 4]  # a probe after 3 steps, the next after 6
    switch.observe(num_slots=8, num_accepted_tokens=6)
    assert switch.lookahead(1) == 4 and switch.gain() == pytest.approx(4.0 / 1.6)
    switch.observe(num_slots=0, num_accepted_tokens=0)  # no slot offered: nothing learnt
    assert switch.acceptance == 0.75


def test_each_probe_that_still_loses_doubles_the_wait_for_the_next():
    switch = SpeculationSwitch(4, draft_cost=0.1, verify_cost=0.05, acceptance=0.0, smoothing=1.0,
                               probe_interval=2, max_probe_interval=8)
    gaps = []
    for _ in range(5):
        steps = 1
        while switch.lookahead(1) == 0:
            steps += 1
        gaps.append(steps)
        switch.observe(num_slots=4, num_accepted_tokens=0)  # the probe: slots offered, nothing accepted
    assert gaps == [1, 4, 8, 8, 8]  # the first step probes; then 2 doubled by each failed probe
    switch.observe(num_slots=4, num_accepted_tokens=4)  # it pays again: on, and the wait starts over
    assert switch.lookahead(1) == 4
    switch.observe(num_slots=4, num_accepted_tokens=0)
    assert [switch.lookahead(1) for _ in range(2)] == [0, 4]


def test_slots_offered_without_a_proposal_count_as_failed_drafts():
    """n-gram lookup over text that does not repeat proposes nothing: for the switch that is
    a loss (each such step gives up running ahead), so it turns speculation off."""
    from spillway.worker.speculative.decoder import SpecDecoder
    from spillway.worker.core.step_plan import ScheduledChunk, StepPlan

    switch = SpeculationSwitch(4, acceptance=0.5, smoothing=1.0)
    decoder = SpecDecoder(NgramProposer(1, 3), switch, sampler=None)
    request = make_request("a", [1, 2, 3, 4, 5])  # nothing repeats
    plan = StepPlan([ScheduledChunk(request, 5, 1, [0], True, num_draft_slots=4)], 1, True)
    assert decoder.propose(plan) is False and plan.run_ahead
    assert switch.acceptance == 0.0 and switch.lookahead(1) == 0


@pytest.mark.parametrize("tokens, count, expected", [
    ([1, 2, 3, 4, 1, 2], 3, (3, 4, 1)),  # "1 2" followed by 3 4 1
    ([5, 1, 2, 9, 1, 2, 7, 1, 2], 2, (7, 1)),  # the latest earlier match wins
    ([1, 2, 3, 4, 5, 6], 3, ()),  # nothing repeats
    ([8, 8, 8], 4, (8,)),  # only what exists
    ([4], 2, ()),
])
def test_ngram_lookup(tokens, count, expected):
    assert ngram_lookup(tokens, 1, 3, count) == expected


def test_ngram_prefers_the_longest_match():
    # The suffix "3 1" occurs once (followed by 5); "1" alone last occurred before 6.
    assert ngram_lookup([3, 1, 5, 0, 1, 6, 3, 1], 1, 2, 1) == (5,)
    assert ngram_lookup([3, 1, 5, 0, 1, 6, 3, 1], 1, 1, 1) == (6,)
    with pytest.raises(ValueError, match="prompt_lookup_min <= prompt_lookup_max"):
        NgramProposer(3, 2)


def test_replay_proposes_the_recorded_continuation_while_it_holds():
    proposer = ReplayProposer({(1, 2): [5, 6, 7, 8]})
    request = make_request("a", [1, 2])
    assert proposer.propose([request], [3])[0].token_ids == (5, 6, 7)
    request.append_token(5)
    assert proposer.propose([request], [9])[0].token_ids == (6, 7, 8)
    request.append_token(4)  # went elsewhere
    assert proposer.propose([request], [2])[0].token_ids == ()
    assert proposer.propose([make_request("b", [3])], [2])[0].token_ids == ()


def test_a_proposer_that_finds_nothing_costs_one_step_then_a_probe_per_growing_interval():
    switch = SpeculationSwitch(4)  # the defaults: it starts off, probing at its first step
    assert switch.lookahead(32) == 4
    switch.observe(num_slots=0, num_accepted_tokens=0)  # a prefill step: no slot, the probe goes on
    on = [1]
    for step in range(2, 257):
        if switch.lookahead(32):
            on.append(step)
            switch.observe(num_slots=32 * 4, num_accepted_tokens=0)
    assert on == [1, 2, 34, 98, 226]  # the wait doubles from 16 after each probe


def test_one_probe_that_pays_turns_speculation_on():
    switch = SpeculationSwitch(4)
    assert switch.lookahead(1) == 4
    switch.observe(num_slots=4, num_accepted_tokens=3)
    assert switch.acceptance == pytest.approx(0.225) and switch.lookahead(1) == 4
