"""TierDriver.plan_before_landing: when the requests that wait for CPU-tier loads are planned
before the loads land (host only: the copier and the scheduler are stand-ins)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from spillway.worker.driver import tier_driver
from spillway.worker.driver.tier_driver import TierDriver
from spillway.worker.driver.timing import REFERENCE_DECODE_STEP_S, LandingDeadlines, StepTiming

NOW = 1000.0
DEADLINES = StepTiming.derive(REFERENCE_DECODE_STEP_S).landing  # the H200's: 6, 20, 3, 14 and 2 ms
PLAN_BEFORE_LANDING_S, PLAN_OVERLAPPED_S = DEADLINES.plan_before_landing_s, DEADLINES.plan_overlapped_s
ARRIVALS_QUIET_S, ARRIVALS_DEADLINE_S = DEADLINES.arrivals_quiet_s, DEADLINES.arrivals_deadline_s
HOLD_IN_FLIGHT_S = DEADLINES.hold_in_flight_s


@dataclass
class Copier:
    land_in: float | None
    by_layer: bool = True
    load_stream: object = "cuda"

    def loads_land_in(self) -> float | None:
        return self.land_in

    def lands_by_layer(self) -> bool:
        return self.by_layer


@dataclass
class Scheduler:
    num_running: int = 50
    num_awaiting_load: int = 50
    last_received: float = NOW - 0.010


@dataclass
class Copies:
    wait_for_loads: bool


@dataclass
class Plan:
    chunks: list
    kv_copies: Copies


@dataclass
class InFlight:
    """A launched step: its plan (how many requests, whether it waits for loads) and the device."""
    num_requests: int = 40
    early: bool = True
    done: bool = False
    plan: Plan = field(init=False)

    def __post_init__(self) -> None:
        self.plan = Plan([object()] * self.num_requests, Copies(self.early))

    def finished(self) -> bool:
        return self.done


def driver(copier: Copier, scheduler: Scheduler | None = None, deadlines: LandingDeadlines = DEADLINES) -> TierDriver:
    planned = TierDriver.__new__(TierDriver)  # only the copier, the scheduler and the deadlines are read
    planned.copier, planned.scheduler, planned.deadlines = copier, scheduler or Scheduler(), deadlines
    return planned


@pytest.fixture(autouse=True)
def clock(monkeypatch):
    monkeypatch.setattr(tier_driver.time, "monotonic", lambda: NOW)


def test_loads_landing_layer_by_layer_are_planned_a_long_lead_ahead_once_arrivals_stop():
    assert driver(Copier(PLAN_OVERLAPPED_S)).plan_before_landing()
    assert not driver(Copier(PLAN_OVERLAPPED_S + 0.001)).plan_before_landing()
    still_arriving = Scheduler(last_received=NOW - ARRIVALS_QUIET_S / 2)
    assert not driver(Copier(PLAN_OVERLAPPED_S), still_arriving).plan_before_landing()
    assert not driver(Copier(PLAN_OVERLAPPED_S, by_layer=False)).plan_before_landing()


def test_a_burst_still_arriving_is_planned_by_the_deadline_where_loads_land_by_layer():
    still_arriving = Scheduler(last_received=NOW)
    assert PLAN_BEFORE_LANDING_S < ARRIVALS_DEADLINE_S < PLAN_OVERLAPPED_S
    assert not driver(Copier(ARRIVALS_DEADLINE_S + 0.001), still_arriving).plan_before_landing()
    assert driver(Copier(ARRIVALS_DEADLINE_S), still_arriving).plan_before_landing()
    assert not driver(Copier(ARRIVALS_DEADLINE_S, by_layer=False), still_arriving).plan_before_landing()


def test_within_the_short_lead_they_are_planned_whatever_arrives_and_however_they_land():
    still_arriving = Scheduler(last_received=NOW)
    assert driver(Copier(PLAN_BEFORE_LANDING_S, by_layer=False), still_arriving).plan_before_landing()
    assert driver(Copier(0.0), still_arriving).plan_before_landing()


@pytest.mark.parametrize("copier, scheduler", [
    (Copier(None), Scheduler()),  # loads still to be queued (paced): no landing time
    (Copier(0.0), Scheduler(num_running=51)),  # another request computes: the loads hold up nobody
    (Copier(0.0), Scheduler(num_running=0, num_awaiting_load=0)),  # nobody waits
    (Copier(0.0, load_stream=None), Scheduler()),  # the CPU: loads land as they are queued
])
def test_nothing_is_planned_early_when_something_else_runs_or_nothing_lands(copier, scheduler):
    assert not driver(copier, scheduler).plan_before_landing()


def test_late_members_go_behind_the_early_step_in_flight_once_arrivals_stop_not_by_the_deadline():
    """40 in the step planned before the landing, 10 arrived since on the same loads: their
    step is planned behind it once no request arrives for a while, or close to the landing;
    the deadline that plans a burst whatever still arrives is not theirs (each step behind
    costs a whole step's device time)."""
    quiet, arriving = Scheduler(num_awaiting_load=10), Scheduler(num_awaiting_load=10, last_received=NOW)
    assert driver(Copier(PLAN_OVERLAPPED_S), quiet).plan_before_landing(InFlight(40))
    assert not driver(Copier(ARRIVALS_DEADLINE_S), arriving).plan_before_landing(InFlight(40))
    assert driver(Copier(PLAN_BEFORE_LANDING_S), arriving).plan_before_landing(InFlight(40))
    assert not driver(Copier(0.0), quiet).plan_before_landing(InFlight(40, early=False))  # it computes
    assert not driver(Copier(0.0), quiet).plan_before_landing(InFlight(39))  # another request computes


def test_an_early_step_stays_in_flight_while_loads_others_wait_for_land_later_than_the_margin():
    step = InFlight(40)
    assert driver(Copier(HOLD_IN_FLIGHT_S + 0.001)).hold_in_flight(step)
    assert not driver(Copier(HOLD_IN_FLIGHT_S)).hold_in_flight(step)  # its tokens come soon: wait for them
    assert not driver(Copier(None)).hold_in_flight(step)  # loads still to be queued: no landing time
    assert not driver(Copier(0.010)).hold_in_flight(InFlight(40, done=True))  # its tokens are there
    assert not driver(Copier(0.010)).hold_in_flight(InFlight(40, early=False))
    assert not driver(Copier(0.010), Scheduler(num_awaiting_load=0)).hold_in_flight(step)  # nobody else waits


def test_a_model_with_a_step_twice_as_long_is_planned_twice_as_far_ahead_of_its_landing():
    slow = StepTiming.derive(2 * REFERENCE_DECODE_STEP_S).landing
    still_arriving = Scheduler(last_received=NOW)
    whole_blocks = Copier(2 * PLAN_BEFORE_LANDING_S, by_layer=False)
    assert not driver(whole_blocks, still_arriving).plan_before_landing()
    assert driver(whole_blocks, still_arriving, slow).plan_before_landing()
    by_layer = Copier(2 * ARRIVALS_DEADLINE_S)
    assert not driver(by_layer, still_arriving).plan_before_landing()
    assert driver(by_layer, still_arriving, slow).plan_before_landing()
    step, landing_soon = InFlight(40), Copier(2 * HOLD_IN_FLIGHT_S)
    assert driver(landing_soon).hold_in_flight(step)
    assert not driver(landing_soon, deadlines=slow).hold_in_flight(step)  # its tokens come later after the landing
