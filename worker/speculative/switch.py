"""When speculation pays: a cost model decides, step by step, how many draft slots to plan.

A step that offers k draft slots per request, of which the fraction r is filled with an
accepted draft (measured: accepted drafts / slots offered, so a proposer that finds nothing
to propose, n-gram lookup over text that does not repeat, counts as one whose drafts fail),
commits

    E(k) = 1 + r * k     tokens per request (the accepted drafts and one more),

and costs, relative to a one-token decode step of the same batch,

    C(k) = 1 + k * (draft_cost + verify_cost)

where draft_cost is proposing one token (0 for prompt lookup) and verify_cost one more row
in the target's forward. Speculation runs while E(k) / C(k) >= 1, that is while
r >= draft_cost + verify_cost, and the batch is at most
`max_batch_size` (a large batch is bound by compute: more rows cost their full price). When
the measured rate makes it a loss it stops, and one step in `probe_interval` speculates
again to measure whether it pays again; each probe that finds it still a loss doubles that
interval (up to `max_probe_interval`: a speculating step cannot run ahead of the device, so
probes cost where speculation never pays). A probe lasts until a step offers draft slots
(a prompt's prefill offers none) and its outcome is observed.

It starts off, with an acceptance of 0 and a probe at the first step: text that never
repeats then costs one speculating step, then one per growing interval. A prior of 0.5
kept it on for the first ~7 steps as well, and on a batch of 32 random prompts those steps
(each committing the step in flight before planning) cost more than the probes. The
defaults are estimates, not measurements.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class SpeculationSwitch:
    """Per-step on/off for speculation, from the batch size and the measured acceptance."""

    num_speculative_tokens: int
    max_batch_size: int = 32
    draft_cost: float = 0.0
    verify_cost: float = 0.05
    acceptance: float = 0.0  # accepted / drafted tokens: a moving average of what is measured
    # Weight of a new measurement. A step's measurement already averages its batch's slots;
    # at 0.3 one probe turns speculation on where it measures 3.3x the break-even acceptance,
    # and a proposer that stops finding drafts turns it off within a few steps.
    smoothing: float = 0.3
    probe_interval: int = 16
    max_probe_interval: int = 256
    _steps_off: int = 0
    _interval: int = 0  # the probe interval now: probe_interval, doubled by each failed probe
    _probing: bool = True  # the first step that offers slots measures the proposer

    def gain(self) -> float:
        """E(k) / C(k) at the current acceptance estimate."""
        k = self.num_speculative_tokens
        return (1.0 + self.acceptance * k) / (1.0 + k * (self.draft_cost + self.verify_cost))

    def lookahead(self, batch_size: int) -> int:
        """Draft slots per request for the next step: k, or 0 to decode plainly."""
        if batch_size > self.max_batch_size:
            return 0
        if self.gain() >= 1.0:
            self._steps_off, self._interval, self._probing = 0, self.probe_interval, False
            return self.num_speculative_tokens
        if self._probing:  # no step has offered a slot since the probe began
            return self.num_speculative_tokens
        self._steps_off += 1
        if self._steps_off >= (self._interval or self.probe_interval):
            self._steps_off, self._probing = 0, True
            return self.num_speculative_tokens
        return 0

    def observe(self, num_slots: int, num_accepted_tokens: int) -> None:
        """One speculating step's counts, draft slots offered and drafts accepted: the
        acceptance estimate moves toward their ratio."""
        if not num_slots:
            return  # nothing learnt (no one-token decode to draft after); a probe goes on
        measured = num_accepted_tokens / num_slots
        self.acceptance += self.smoothing * (measured - self.acceptance)
        if self._probing:
            self._probing = False
            if self.gain() < 1.0:
                self._interval = min(2 * (self._interval or self.probe_interval), self.max_probe_interval)
