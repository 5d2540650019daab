"""When the gateway gives up on a worker whose process may still be there: one that says nothing
(stopped, frozen, cut off) or one whose step runs on (stuck for good).

    any message of the worker                -> heard(now)
    a heartbeat (StepOutputs.iteration_s)    -> step_overrun(iteration_s): past step_timeout_s?
    twice a second (WorkerLink._watch)       -> silence(now): past heartbeat_timeout_s?
                                                should_probe(now): ask for Stats meanwhile

The worker beats from a thread of its own (worker/heartbeat.py), through a step of seconds
too, so silence means the whole process is deaf, never that a step is long. A worker that does
not beat (an older one) is judged by its answers to the probe, which come between steps.
"""

from __future__ import annotations

PROBE_INTERVAL_S = 1.0


class Liveness:
    """The two bounds of one link, and when the worker last said anything."""

    def __init__(self, heartbeat_timeout_s: float | None, step_timeout_s: float | None) -> None:
        """None: no such bound (the offline `LLM`, whose steps and pauses are the caller's)."""
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.step_timeout_s = step_timeout_s
        self.last_heard = 0.0
        self._last_probe = 0.0

    def heard(self, now: float) -> None:
        self.last_heard = now

    def step_overrun(self, iteration_s: float) -> str | None:
        """Why the worker is lost, if the step its heartbeat reports is past the bound."""
        if self.step_timeout_s is None or iteration_s <= self.step_timeout_s:
            return None
        return f"the worker's step has run for {iteration_s:.0f} s, past the step timeout of {self.step_timeout_s:g} s"

    def silence(self, now: float) -> str | None:
        """Why the worker is lost, if it has been silent past the bound."""
        silent = now - self.last_heard
        if self.heartbeat_timeout_s is None or silent <= self.heartbeat_timeout_s:
            return None
        return f"the worker has been silent for {silent:.0f} s, past the heartbeat timeout of " \
               f"{self.heartbeat_timeout_s:g} s"

    def should_probe(self, now: float) -> bool:
        """Whether to ask a quiet worker for Stats now: at most once a second, and early enough
        within a short bound that an answer can still come."""
        if self.heartbeat_timeout_s is None or now - self._last_probe <= PROBE_INTERVAL_S:
            return False
        if now - self.last_heard <= min(PROBE_INTERVAL_S, self.heartbeat_timeout_s / 3):
            return False
        self._last_probe = now
        return True
