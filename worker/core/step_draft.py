"""A step as the scheduler plans it, before it becomes a `StepPlan`."""

from __future__ import annotations

from dataclasses import dataclass, field

from spillway.worker.core.fair_share import FairShare
from spillway.worker.core.request import Request
from spillway.worker.core.step_plan import ScheduledChunk


@dataclass(slots=True)
class StepDraft:
    """The plan of a step as it is built: its chunks by request id, in plan order (a preempted
    request's chunk is dropped and its tokens go back to the budget), the budget left, and the
    client requests' shares of the step.

    Invariant: `budget` is the step's budget less every chunk's tokens and draft slots."""

    budget: int
    share: FairShare
    chunks: dict[str, ScheduledChunk] = field(default_factory=dict)

    def plan(self, request: Request, num_tokens: int, slot_table: list[int]) -> None:
        """The request's next `num_tokens` from its computed ones; the chunk samples when it
        reaches the request's last token (its pending one included)."""
        start = request.num_computed_tokens
        sample = start + num_tokens == request.num_tokens + request.num_pending_tokens
        self.chunks[request.request_id] = ScheduledChunk(request, start, num_tokens, slot_table, sample)
        self.budget -= num_tokens
        self.share.planned(request, num_tokens)

    def reserve_drafts(self, chunk: ScheduledChunk, num_draft_slots: int, slot_table: list[int]) -> None:
        """`num_draft_slots` KV slots after `chunk`, one of this draft's, for draft tokens;
        `slot_table` covers them. The chunk is not handed out yet: it is changed in place
        rather than copied, since this runs for every decode of a speculating step."""
        chunk.num_draft_slots, chunk.slot_table = num_draft_slots, slot_table
        self.budget -= num_draft_slots

    def drop(self, request: Request) -> None:
        chunk = self.chunks.pop(request.request_id, None)
        if chunk is not None:
            self.budget += chunk.num_tokens + chunk.num_draft_slots
