"""The order of `Engine.step`'s calls in each of its modes, the model and the device faked: when
the step in flight is committed relative to the plan and the launch (before planning, before
the launch, after it, or left in flight), and whether the step launched is committed at once
or one call later.

Each plan is named after its step; a call is written as it happened, e.g. `launch B fed by A
ahead`: step B launched with A's tokens fed on the device, its own read one call later."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from spillway.worker.core.step_plan import NO_KV_COPIES, KVCopies, StepResult
from spillway.worker.driver import engine as engine_module
from spillway.worker.driver.engine import Engine
from spillway.worker.driver.kv_pulls import KvPulls
from spillway.worker.driver.pipeline import LaunchedStep
from spillway.worker.driver.tier_driver import NullTierDriver

LOADS = KVCopies(cpu_to_gpu=((0, 1),), load_batch=1)


@dataclass
class Script:
    """What the fakes answer, and the calls they saw."""

    calls: list[str] = field(default_factory=list)
    plan: Plan | None = None  # the scheduler's next answer
    finished: set[str] = field(default_factory=set)  # launched steps the device has finished
    lookahead: int = 0
    before_landing: bool = False
    hold: bool = False
    fed_by: str | None = None
    record_forwards: bool = False  # the executor's forwards among the calls too


@dataclass
class Plan:
    """A scheduler's answer, as far as `Engine.step` reads it."""

    name: str
    script: Script = field(repr=False)
    computes: bool = True
    run_ahead: bool = False
    kv_copies: KVCopies = NO_KV_COPIES
    samples_after_commit: bool = False  # a grammar's mask, filled once the step before is committed
    # Its every request finishes with a token of the step in flight: dropped by the commit.
    ends_with_previous: bool = False
    chunks: list[str] = field(init=False)

    def __post_init__(self) -> None:
        self.chunks = [self.name] if self.computes else []

    def drop_finished(self) -> None:
        self.script.calls.append(f"drop_finished {self.name}")
        if self.ends_with_previous:
            self.chunks = []


class Scheduler:
    num_running = 1
    num_awaiting_load = 1

    def __init__(self, script: Script) -> None:
        self.script = script

    def schedule(self, ahead: bool = False, lookahead: int = 0, before_landing: bool = False) -> Plan:
        flags = ["ahead"] * ahead + [f"lookahead={lookahead}"] * bool(lookahead) + ["before_landing"] * before_landing
        self.script.calls.append(" ".join(["schedule", *flags]))
        return self.script.plan

    def update(self, plan: Plan, sampled: dict[str, int], accepted) -> list[StepResult]:
        self.script.calls.append(f"commit {plan.name}")
        request = SimpleNamespace(request_id=plan.name, params=SimpleNamespace(prompt_logprobs=None))
        return [StepResult(request, [1], None)]

    def mark_in_flight(self, plan: Plan) -> None:
        self.script.calls.append(f"mark_in_flight {plan.name}")


class Tier:
    def __init__(self, script: Script) -> None:
        self.script = script

    def before_step(self) -> None:
        self.script.calls.append("before_step")

    def plan_before_landing(self, in_flight: LaunchedStep | None = None) -> bool:
        self.script.calls.append(f"plan_before_landing? {in_flight.plan.name if in_flight else '-'}")
        return self.script.before_landing

    def hold_in_flight(self, step: LaunchedStep) -> bool:
        self.script.calls.append(f"hold_in_flight? {step.plan.name}")
        return self.script.hold


class Spec:
    def __init__(self, script: Script) -> None:
        self.script = script

    def lookahead(self, batch_size: int) -> int:
        self.script.calls.append("lookahead?")
        return self.script.lookahead

    def propose(self, plan: Plan) -> bool:
        self.script.calls.append(f"propose {plan.name}")
        plan.run_ahead = False  # drafted: a plan with drafts does not run ahead
        return True

    def forget(self, request_id: str) -> None:
        pass


class Executor:
    def __init__(self, script: Script) -> None:
        self.script = script

    def execute(self, packed, feed) -> None:
        if self.script.record_forwards:
            self.script.calls.append(f"forward {self.script.plan.name}")
        return None

    def copy_kv(self, copies: KVCopies) -> None:
        self.script.calls.append("copy_kv")


@dataclass
class Copied:
    """The event after a step's token copy: asks the script whether the device finished it."""

    script: Script
    name: str

    def query(self) -> bool:
        self.script.calls.append(f"finished? {self.name}")
        return self.name in self.script.finished


class Readback:
    def __init__(self, script: Script) -> None:
        self.script = script

    def start(self, plan: Plan, requests, token_ids, logprobs, ahead: bool) -> LaunchedStep:
        fed = f" fed by {self.script.fed_by}" if self.script.fed_by else ""
        self.script.calls.append(f"launch {plan.name}{fed}{' ahead' if ahead else ''}")
        return LaunchedStep(plan, None, None, Copied(self.script, plan.name), {}, {})


@pytest.fixture(autouse=True)
def packing(monkeypatch):
    """No model: the packed step only says which step fed its pending tokens."""
    def pack_step(plan: Plan, previous: LaunchedStep | None):
        plan.script.fed_by = previous.plan.name if previous is not None else None
        return SimpleNamespace(feed_rows=[], num_prompt_rows=0, sample_rows=[])

    monkeypatch.setattr(engine_module, "pack_step", pack_step)


def make_engine(script: Script, async_scheduling: bool = True, tier: bool = False, spec: bool = False) -> Engine:
    engine = Engine.__new__(Engine)  # only what a step reads
    engine.scheduler, engine.executor = Scheduler(script), Executor(script)
    engine.tier = Tier(script) if tier else NullTierDriver()
    engine.spec = Spec(script) if spec else None
    engine.async_scheduling = async_scheduling
    engine._readback = Readback(script)
    engine._in_flight, engine._holding = None, False
    engine.num_async_steps, engine.num_steps, engine.last_plan = 0, 0, None
    engine.debug_invariants = False
    engine.constrained = SimpleNamespace(num_compiling=0)  # no grammar compiling
    engine.kv_pulls = KvPulls(timeout_s=1.0)  # no request waiting for KV blocks
    return engine


def step(engine: Engine, script: Script, name: str, **plan) -> tuple[list[str], list[str]]:
    """One call planning `name`: the calls it made, the request ids of its deltas (one per
    step committed, named after it)."""
    script.calls.clear()
    script.plan = Plan(name, script, **plan)
    deltas = engine.step()
    return script.calls[:], [delta.request_id for delta in deltas]


def test_synchronous_steps_are_launched_and_committed_at_once():
    script = Script()
    engine = make_engine(script, async_scheduling=False)
    assert step(engine, script, "A", run_ahead=True) == (["schedule", "launch A", "commit A"], ["A"])
    assert step(engine, script, "B", run_ahead=True) == (["schedule", "launch B", "commit B"], ["B"])
    assert engine.num_async_steps == 0 and engine._in_flight is None


def test_a_plan_that_runs_ahead_is_launched_before_the_step_in_flight_is_committed():
    script = Script()
    engine = make_engine(script)
    assert step(engine, script, "A", run_ahead=True) == (["schedule", "launch A ahead", "mark_in_flight A"], [])
    assert step(engine, script, "B", run_ahead=True) == (
        ["finished? A", "schedule ahead", "launch B fed by A ahead", "commit A", "mark_in_flight B"], ["A"])
    # A plan that reads the tokens before on the host: the step in flight first, then the new one at once.
    assert step(engine, script, "C") == (
        ["finished? B", "schedule ahead", "commit B", "drop_finished C", "launch C", "commit C"], ["B", "C"])
    assert step(engine, script, "D", computes=False, kv_copies=LOADS) == (["schedule", "copy_kv"], [])
    assert engine.num_async_steps == 2 and engine._in_flight is None


def test_a_plan_sampled_under_masks_runs_its_forward_ahead_and_samples_after_the_commit():
    script = Script(record_forwards=True)
    engine = make_engine(script)
    assert step(engine, script, "A", run_ahead=True, samples_after_commit=True) == (
        ["schedule", "forward A", "launch A ahead", "mark_in_flight A"], [])
    # B's forward is fed by A's tokens on the device; A is committed (the grammars advance)
    # before B's masks are filled and its sampling launched.
    assert step(engine, script, "B", run_ahead=True, samples_after_commit=True) == (
        ["finished? A", "schedule ahead", "forward B", "commit A", "launch B fed by A ahead", "mark_in_flight B"],
        ["A"])
    assert step(engine, script, "C", run_ahead=True) == (
        ["finished? B", "schedule ahead", "forward C", "launch C fed by B ahead", "commit B", "mark_in_flight C"],
        ["B"])
    assert engine.num_async_steps == 3


def test_a_plan_whose_requests_the_step_in_flight_ends_launches_nothing():
    script = Script()
    engine = make_engine(script)
    step(engine, script, "A", run_ahead=True)
    assert step(engine, script, "B", ends_with_previous=True, kv_copies=LOADS) == (
        ["finished? A", "schedule ahead", "commit A", "drop_finished B", "copy_kv"], ["A"])
    assert engine._in_flight is None


def test_a_step_the_device_has_finished_is_committed_before_planning():
    script = Script()
    engine = make_engine(script)
    step(engine, script, "A", run_ahead=True)
    script.finished.add("A")
    assert step(engine, script, "B", run_ahead=True) == (
        ["finished? A", "commit A", "schedule", "launch B ahead", "mark_in_flight B"], ["A"])
    assert step(engine, script, "C") == (["finished? B", "schedule ahead", "commit B", "drop_finished C",
                                          "launch C", "commit C"], ["B", "C"])


def test_a_step_that_speculates_commits_the_step_in_flight_before_planning_and_itself_at_once():
    script = Script()
    engine = make_engine(script, spec=True)
    assert step(engine, script, "A", run_ahead=True) == (
        ["lookahead?", "schedule", "launch A ahead", "mark_in_flight A"], [])
    script.lookahead = 4  # the device's state is not asked: the drafts need A's tokens anyway
    assert step(engine, script, "B", run_ahead=True) == (
        ["lookahead?", "commit A", "schedule lookahead=4", "propose B", "launch B", "commit B"], ["A", "B"])
    assert step(engine, script, "C", run_ahead=True) == (
        ["lookahead?", "schedule lookahead=4", "propose C", "launch C", "commit C"], ["C"])
    assert engine._in_flight is None


def test_with_a_tier_synchronous_steps_ask_it_before_planning():
    script = Script()
    engine = make_engine(script, async_scheduling=False, tier=True)
    assert step(engine, script, "A", run_ahead=True) == (
        ["before_step", "plan_before_landing? -", "schedule", "launch A", "commit A"], ["A"])


def test_a_step_planned_before_the_landing_is_held_in_flight_then_a_late_member_goes_behind_it():
    script = Script(before_landing=True)
    engine = make_engine(script, tier=True)
    assert step(engine, script, "A", run_ahead=True) == (
        ["before_step", "plan_before_landing? -", "schedule before_landing", "launch A ahead",
         "mark_in_flight A"], [])
    script.before_landing, script.hold = False, True  # loads land later than the margin
    assert step(engine, script, "B", computes=False, kv_copies=LOADS) == (
        ["before_step", "finished? A", "plan_before_landing? A", "schedule ahead", "hold_in_flight? A",
         "copy_kv"], [])
    assert engine._in_flight.plan.name == "A" and engine.waits_for_loads
    assert step(engine, script, "B", computes=False) == (
        ["before_step", "finished? A", "plan_before_landing? A", "schedule ahead", "hold_in_flight? A"], [])
    script.before_landing = True  # arrivals stopped: the late member is planned behind A
    assert step(engine, script, "C", run_ahead=True) == (
        ["before_step", "finished? A", "plan_before_landing? A", "schedule ahead before_landing",
         "launch C fed by A ahead", "commit A", "mark_in_flight C"], ["A"])
    script.before_landing, script.hold = False, False  # they land soon: wait for C's tokens
    assert step(engine, script, "D", computes=False) == (
        ["before_step", "finished? C", "plan_before_landing? C", "schedule ahead", "hold_in_flight? C",
         "commit C", "drop_finished D"], ["C"])
    assert engine._in_flight is None and not engine._holding


def test_a_held_step_the_device_has_finished_is_committed_before_planning():
    script = Script(before_landing=True)
    engine = make_engine(script, tier=True)
    step(engine, script, "A", run_ahead=True)
    script.before_landing, script.hold = False, True
    step(engine, script, "B", computes=False)
    assert engine._holding
    script.finished.add("A")
    assert step(engine, script, "C", computes=False) == (
        ["before_step", "finished? A", "commit A", "plan_before_landing? -", "schedule"], ["A"])
    assert engine._in_flight is None and not engine._holding
