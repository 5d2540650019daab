"""When `Engine.step` commits: the step in flight and the step it launches, placed around the
call's plan and launch, as data (worker/driver/pipeline.py explains the run ahead).

    call:   [BEFORE_PLAN] plan [BEFORE_LAUNCH] launch [AFTER_LAUNCH]      ... [NEXT_CALL]

The step in flight (launched by an earlier call, its tokens not read yet) is committed

    BEFORE_PLAN    when the plan may draft (speculation's lookahead: drafts follow committed
                   tokens only), or the device has finished it: running ahead of an idle device
                   gains nothing, and its tokens (a burst's first) should not wait for the
                   admission of the requests that arrived meanwhile;
    NEXT_CALL      when the plan computes nothing and the CPU tier holds it there while loads
                   land (`TierDriver.hold_in_flight`): a later call commits it;
    AFTER_LAUNCH   when the plan runs ahead: the new step is launched first, fed its tokens on
                   the device;
    BEFORE_LAUNCH  otherwise: the plan reads its tokens on the host (and the commit may end some
                   of the plan's requests, `StepPlan.drop_finished`).

The step launched now is committed AFTER_LAUNCH, at once, or, when its plan runs ahead, by the
next call (NEXT_CALL). At most one step is committed at each point.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum


class InFlight(IntEnum):
    """The step in flight as a call of `Engine.step` finds it."""

    NOTHING = 0  # nothing in flight
    RUNNING = 1  # on the device, or not asked (with lookahead its state does not matter)
    FINISHED = 2  # the device has produced its tokens (`LaunchedStep.finished`)


class Commit(IntEnum):
    """Where in a call of `Engine.step` a step is committed (module doc)."""

    NO_STEP = 0  # no step in flight: nothing to commit
    BEFORE_PLAN = 1
    BEFORE_LAUNCH = 2
    AFTER_LAUNCH = 3
    NEXT_CALL = 4


@dataclass(frozen=True, slots=True)
class CommitOrder:
    """Where one call commits the step in flight and the step it launches (if its plan computes)."""

    in_flight: Commit
    launched: Commit  # AFTER_LAUNCH or NEXT_CALL


# The members by module names, for the engine's every step: on Python 3.11 a member read through
# its class costs about as much as a function call.
NOTHING, RUNNING, FINISHED = InFlight
NO_STEP, BEFORE_PLAN, BEFORE_LAUNCH, AFTER_LAUNCH, NEXT_CALL = Commit

# Every order there is, by [runs ahead][the step in flight's place]: nothing is built per step.
_ORDERS = tuple(tuple(CommitOrder(place, launched) for place in Commit) for launched in (AFTER_LAUNCH, NEXT_CALL))


def commit_order(in_flight: InFlight, lookahead: int, holds: bool = False, run_ahead: bool = False) -> CommitOrder:
    """Where a call commits the step in flight and the step it launches.

    `lookahead`: draft slots the plan reserves (speculation). `holds`: the plan computes nothing
    and the tier holds the step in flight. `run_ahead`: the plan may run ahead (asynchronous
    scheduling and `StepPlan.run_ahead`). Whether the step in flight goes BEFORE_PLAN depends on
    `in_flight` and `lookahead` alone: the engine asks once before planning, without the plan's
    answers, and again once the plan is made."""
    if in_flight is NOTHING:
        place = NO_STEP
    elif lookahead or in_flight is FINISHED:
        place = BEFORE_PLAN
    elif holds:
        place = NEXT_CALL
    elif run_ahead:
        place = AFTER_LAUNCH
    else:
        place = BEFORE_LAUNCH
    return _ORDERS[run_ahead][place]
