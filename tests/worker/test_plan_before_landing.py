"""TierDriver.plan_before_landing: when the requests that wait for CPU-tier loads are planned
before the loads land (host only: the copier and the scheduler are stand-ins)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from spillway.worker import tier_driver
from spillway.worker.tier_driver import (ARRIVALS_DEADLINE_S, ARRIVALS_QUIET_S, PLAN_BEFORE_LANDING_S,
                                         PLAN_OVERLAPPED_S, TierDriver)

NOW = 1000.0


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


def driver(copier: Copier, scheduler: Scheduler | None = None) -> TierDriver:
    planned = TierDriver.__new__(TierDriver)  # only the copier and the scheduler are read
    planned.copier, planned.scheduler = copier, scheduler or Scheduler()
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
