"""commit_order (worker/driver/commit_order.py): where a call of `Engine.step` commits the step in
flight and the step it launches, for every mode of the step."""

from __future__ import annotations

import itertools

import pytest

from spillway.worker.driver.commit_order import (AFTER_LAUNCH, BEFORE_LAUNCH, BEFORE_PLAN, FINISHED, NEXT_CALL,
                                                 NO_STEP, NOTHING, RUNNING, Commit, CommitOrder, InFlight,
                                                 commit_order)


@pytest.mark.parametrize("in_flight, lookahead, holds, run_ahead, expected", [
    # nothing in flight: the new step is committed at once, or by the next call when it runs ahead
    (NOTHING, 0, False, False, (NO_STEP, AFTER_LAUNCH)),
    (NOTHING, 0, False, True, (NO_STEP, NEXT_CALL)),
    (NOTHING, 4, False, False, (NO_STEP, AFTER_LAUNCH)),
    # a plan that reads the tokens before on the host: the step in flight first, then the new one
    (RUNNING, 0, False, False, (BEFORE_LAUNCH, AFTER_LAUNCH)),
    # a plan that runs ahead: launched first, fed on the device; the step in flight after the launch
    (RUNNING, 0, False, True, (AFTER_LAUNCH, NEXT_CALL)),
    # the plan computes nothing and the tier holds the step in flight while loads land
    (RUNNING, 0, True, False, (NEXT_CALL, AFTER_LAUNCH)),
    # the device has finished it: committed before planning, whatever the plan then does
    (FINISHED, 0, False, False, (BEFORE_PLAN, AFTER_LAUNCH)),
    (FINISHED, 0, False, True, (BEFORE_PLAN, NEXT_CALL)),
    # drafts follow committed tokens: before planning, the device not asked
    (RUNNING, 4, False, False, (BEFORE_PLAN, AFTER_LAUNCH)),
    (RUNNING, 4, False, True, (BEFORE_PLAN, NEXT_CALL)),  # slots reserved, nothing drafted
])
def test_each_mode_places_the_step_in_flight_and_the_step_launched(in_flight, lookahead, holds, run_ahead,
                                                                    expected):
    assert commit_order(in_flight, lookahead, holds, run_ahead) == CommitOrder(*expected)


ALL_INPUTS = list(itertools.product(InFlight, (0, 1, 4), (False, True), (False, True)))


@pytest.mark.parametrize("in_flight, lookahead, holds, run_ahead", ALL_INPUTS)
def test_asked_before_planning_it_already_knows_whether_the_step_in_flight_goes_first(in_flight, lookahead, holds,
                                                                                       run_ahead):
    before = commit_order(in_flight, lookahead)
    after = commit_order(in_flight, lookahead, holds, run_ahead)
    assert (before.in_flight is BEFORE_PLAN) == (after.in_flight is BEFORE_PLAN)
    assert (after.in_flight is NO_STEP) == (in_flight is NOTHING)


@pytest.mark.parametrize("in_flight, lookahead, holds, run_ahead", ALL_INPUTS)
def test_the_step_launched_waits_for_the_next_call_only_when_it_runs_ahead_and_no_point_commits_two(
        in_flight, lookahead, holds, run_ahead):
    order = commit_order(in_flight, lookahead, holds, run_ahead)
    assert order.launched is (NEXT_CALL if run_ahead else AFTER_LAUNCH)
    assert order.in_flight is not order.launched or order.in_flight is NEXT_CALL


def test_an_order_is_one_of_a_few_built_once():
    assert commit_order(RUNNING, 0, False, True) is commit_order(RUNNING, 0, False, True)
    orders = {id(commit_order(*inputs)) for inputs in ALL_INPUTS}
    assert len(orders) <= 2 * len(Commit)
