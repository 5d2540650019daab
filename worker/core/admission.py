"""The admission side of the scheduler, and its reverse: waiting requests moved to running on
their prefix-cache hits (the hits counted), and running ones preempted back to waiting.

`Scheduler` (worker/core/scheduler.py) inherits these from `Admission`: `_admit_waiting` takes
waiting requests in the order FairShare (worker/core/fair_share.py) gives, while the step's budget,
the sequence slots and the blocks allow, making room from the client request holding the most
where that evens the holdings out; `_admit`, a lookup of the request's block hashes (GPU, then
the CPU tier), the blocks for its hits and its first chunk, and, when a hit still has to load,
no chunk this step (it computes once its load batch has landed); `_allocate_or_preempt`, a
running request's next blocks, preempting until they fit. They read the scheduler's block
manager, queues and counters. `queue_key` orders both queues; `StepDraft` is a step as it is
planned.
"""

from __future__ import annotations

import time
from bisect import insort
from dataclasses import dataclass, field

from spillway.worker.core.fair_share import FairShare
from spillway.worker.core.request import Request, RequestStatus
from spillway.worker.core.step_plan import ScheduledChunk


@dataclass(slots=True)
class StepDraft:
    """The plan of a step as it is built: its chunks by request id, in plan order (a preempted
    request's chunk is dropped and its tokens go back to the budget), and the budget left."""

    budget: int
    share: FairShare
    chunks: dict[str, ScheduledChunk] = field(default_factory=dict)

    def add(self, chunk: ScheduledChunk) -> None:
        self.chunks[chunk.request.request_id] = chunk
        self.budget -= chunk.num_tokens

    def drop(self, request: Request) -> None:
        chunk = self.chunks.pop(request.request_id, None)
        if chunk is not None:
            self.budget += chunk.num_tokens + chunk.num_draft_slots


def queue_key(request: Request) -> tuple[int, int]:
    """The order of the waiting and running queues: priority, then arrival (FCFS)."""
    return (request.priority, request.arrival_index)


class Admission:
    """Admission and preemption of `Scheduler` (module doc)."""

    def _admit_waiting(self, step: StepDraft, join_through: int, ahead: bool) -> None:
        """Admit waiting requests in FairShare's order while the budget, the sequence slots,
        the free blocks and the shares allow. A request that finds no slot or too few blocks
        takes them from the largest holder where that evens the holdings out (not `ahead`:
        nothing is preempted then)."""
        while self.waiting and step.budget > 0:
            index = step.share.next_admission(self.waiting)
            if index is None:
                return  # after running out of blocks, it would only be preempted again
            request = self.waiting[index]
            limit = step.share.cap(request, step.budget)
            if not limit:
                return  # its client request has had its share: it comes after the others' turn
            admitted, chunk = (False, None)
            if self._has_free_seq_slot():
                admitted, chunk = self._admit(index, limit, join_through)
            if not admitted:
                if ahead or not self._preempt_for(request, step):
                    return  # nobody overtakes a request that does not fit
                continue
            step.share.admitted(request)
            if chunk is not None:  # None: it waits for a load
                step.add(chunk)
                step.share.planned(request, chunk.num_tokens)

    def _preempt_for(self, request: Request, step: StepDraft) -> bool:
        """Preempt the largest holder's newest choice to make room for `request`, where that
        evens the holdings out (FairShare.evens_out); whether it did."""
        if not self.running:
            return False
        index = step.share.victim(self.running)
        if not step.share.evens_out(self.running[index], request):
            return False
        self._preempt(index, step)
        return True

    def _allocate_or_preempt(self, request: Request, num_tokens: int, step: StepDraft) -> bool:
        """Blocks for the request's next `num_tokens`, preempting running requests until they
        fit: the newest choice of the client request holding the most (FairShare.victim), its
        chunk dropped from the step if it had one. False when the request itself had to go."""
        num_tokens_covered = request.num_computed_tokens + num_tokens
        while not self.block_manager.allocate(request.request_id, num_tokens_covered):
            if self._preempt(step.share.victim(self.running), step) is request:
                return False
        return True

    def _preempt(self, index: int, step: StepDraft) -> Request:
        """Send `running[index]` back to waiting, its blocks released and its chunk of this
        step dropped; it recomputes what the prefix cache no longer holds when resumed."""
        request = self.running.pop(index)
        step.drop(request)
        step.share.preempted(request)
        self._awaiting_load.pop(request.request_id, None)
        self.block_manager.free(request.request_id)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        insort(self.waiting, request, key=queue_key)
        return request

    def _admit(self, index: int, budget: int, join_through: int = 0) -> tuple[bool, ScheduledChunk | None]:
        """Move `waiting[index]` to running: (True, its first chunk), or
        (True, None) when it waits for a load this step; (False, None) when it does not fit.
        `join_through`: the step waits for the load batches up to it (planned before the
        landing), so a request waiting for no later one computes in it."""
        manager, request = self.block_manager, self.waiting[index]
        # The last token is always recomputed: its logits give the next token. Prompt
        # logprobs need every prompt position computed: such a request reads no cache.
        num_hashes = (request.num_tokens - 1) // self.block_size
        if request.params.prompt_logprobs is not None:
            num_hashes = 0
        cached = manager.look_up(request.block_hashes, num_hashes)
        num_cached = len(cached) * self.block_size
        num_tokens = min(request.num_tokens - num_cached, budget)
        num_on_gpu = cached.num_on_gpu * self.block_size  # before allocate loads them
        if not manager.allocate(request.request_id, num_cached + num_tokens, cached):
            return False, None
        del self.waiting[index]
        if request.status == RequestStatus.WAITING:  # first scheduling; a resume is no hit
            request.num_cached_tokens = num_cached
            request.queued_s = time.monotonic() - request.received
            if manager.enable_prefix_caching:
                self._count_hits(request.num_prompt_tokens, num_on_gpu, num_cached - num_on_gpu)
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_cached
        insort(self.running, request, key=queue_key)
        awaited = manager.awaited_load_batch(request.request_id)
        if awaited > join_through:
            self._awaiting_load[request.request_id] = awaited
            return True, None
        if awaited:
            manager.wait_for_loads_this_step()
        return True, self._chunk(request, num_tokens)

    def _count_hits(self, num_queried: int, num_on_gpu: int, num_on_cpu: int) -> None:
        self.prefix_cache_queries += num_queried
        self.prefix_cache_hits += num_on_gpu + num_on_cpu
        self.cached_tokens_gpu += num_on_gpu
        self.cached_tokens_cpu += num_on_cpu
        if self.block_manager.num_cpu_blocks:  # the tokens past the GPU hits were looked up there
            self.cpu_cache_queries += num_queried - num_on_gpu
            self.cpu_cache_hits += num_on_cpu
