"""A step's plan: what the scheduler decided, as data the rest of the step reads.

The plan lives on the driver (it points at the requests); what the executors receive is
packed from it (worker/driver/pipeline.py). Features to come are fields here, not branches in the
loop: KV copies between tiers, draft tokens to verify (`ScheduledChunk.draft_token_ids`).
"""

from __future__ import annotations

from dataclasses import dataclass

from spillway.protocol.messages import FinishReason
from spillway.worker.core.request import Request, RequestStatus


@dataclass(slots=True)
class ScheduledChunk:
    """Compute `all_token_ids[start : start + num_tokens]` of `request` this step."""

    request: Request
    start: int  # == request.num_computed_tokens when scheduled
    num_tokens: int
    slot_table: list[int]  # GPU slots of its blocks, a snapshot covering start + num_tokens tokens
    sample: bool  # the chunk reaches the request's last token: sample the next one
    # KV slots reserved after the chunk for draft tokens (its slot table covers them): at most
    # this many may be proposed. Set on one-token decodes when the step speculates.
    num_draft_slots: int = 0
    # Proposed tokens after the chunk's last one, verified in the same forward (worker/speculative/).
    # Their KV is written but counts as computed only where they are accepted.
    draft_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class KVCopies:
    """Block copies between the KV tiers (the CPU tier, worker/kv_tier/copier.py), as
    (src_slot, dst_slot) pairs per direction: stores that must finish before the step's
    forward (its GPU slots are reused), loads that land during it.

    `ahead_to_cpu`: stores of cached blocks the GPU keeps (write-back ahead of eviction),
    which nothing waits for until a later step reuses one of their GPU slots; that step's
    `wait_for_ahead` is then set, and its forward and loads wait for every ahead store.

    Loads come in batches, one per request admitted on CPU-tier hits (numbered 1, 2, ... in
    the order they are planned): `load_batch_ends` holds each of the step's batches as
    (number, end of its pairs in `cpu_to_gpu`), `load_batch` the last one's number (0 without
    loads). A batch is what the device reports as landed, and what its request waits for, so
    a request computes once its own blocks are in, not those of requests admitted with it.
    No forward waits for loads, except one of a step that reuses the GPU slot of a block
    whose load may still run, or one planned before the loads land (`wait_for_loads`: it
    waits for every load queued). `wait_by_layer`: the step was planned before the landing,
    and its forward may wait layer by layer (each layer after that layer of every load).

    `store_batch`: the number of the step's stores, both kinds, as one batch (1, 2, ... in the
    order taken; 0 without stores): what the device reports as written into host memory, so
    that a producer serves a CPU copy only once its bytes are there (`CpuTier.readable_copy`)."""

    gpu_to_cpu: tuple[tuple[int, int], ...] = ()
    cpu_to_gpu: tuple[tuple[int, int], ...] = ()
    ahead_to_cpu: tuple[tuple[int, int], ...] = ()
    wait_for_ahead: bool = False
    load_batch: int = 0
    load_batch_ends: tuple[tuple[int, int], ...] = ()
    wait_for_loads: bool = False
    wait_by_layer: bool = False
    store_batch: int = 0

    def load_batches(self) -> tuple[tuple[int, int], ...]:
        """(number, end) of each load batch; loads given without batches are one, `load_batch`."""
        if self.load_batch_ends or not self.cpu_to_gpu:
            return self.load_batch_ends
        return ((self.load_batch, len(self.cpu_to_gpu)),)


NO_KV_COPIES = KVCopies()


@dataclass(slots=True)
class StepPlan:
    """What one step computes: the scheduler's whole answer, as data.

    `run_ahead`: every token the step samples is one the device chooses alone
    (`Request.samples_on_device`, min_tokens reached), or from a grammar's mask
    (`Request.samples_after_commit`), so the step may be launched before the tokens of the step
    before are read, and committed one step later (worker/driver/pipeline.py).
    `samples_after_commit`: some of those rows take a mask, which the host fills once the step
    before is committed: the step's forward is launched first, its sampling after that commit.
    """

    chunks: list[ScheduledChunk]
    num_batched_tokens: int
    run_ahead: bool = False
    kv_copies: KVCopies = NO_KV_COPIES
    samples_after_commit: bool = False

    def drop_finished(self) -> None:
        """Leave out the chunks of requests that finished since the plan was made (by a
        token of the step before, when the plan was made ahead of it)."""
        self.chunks = [chunk for chunk in self.chunks if chunk.request.status == RequestStatus.RUNNING]


@dataclass(slots=True)
class StepResult:
    request: Request
    new_token_ids: list[int]
    finish_reason: FinishReason | None
    num_cached_tokens: int = -1  # set on the request's first output only
    queued_s: float = -1.0  # likewise
