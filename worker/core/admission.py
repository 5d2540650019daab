"""Admission and its reverse: waiting requests moved to running on their prefix-cache hits (the
hits counted), and running ones preempted back to waiting.

`Admission` works on the scheduler's queues (worker/core/scheduler.py), which it is given at
construction and changes in place: `admit_waiting` takes waiting requests in the order FairShare
(worker/core/fair_share.py) gives, while the step's budget, the sequence slots and the blocks
allow, making room from the client request holding the most where that evens the holdings out;
each admission is a lookup of the request's block hashes (GPU, then the CPU tier), the blocks
for its hits and its first chunk, and, when a hit still has to load, no chunk this step (it
computes once its load batch has landed). `allocate_or_preempt` gives a running request its next
blocks, preempting until they fit. `queue_key` orders both queues.
"""

from __future__ import annotations

import time
from bisect import insort
from dataclasses import dataclass, field

from spillway.worker.core.block_manager import BlockManager
from spillway.worker.core.request import Request, RequestStatus
from spillway.worker.core.step_draft import StepDraft


def queue_key(request: Request) -> tuple[int, int]:
    """The order of the waiting and running queues: priority, then arrival (FCFS)."""
    return (request.priority, request.arrival_index)


@dataclass(slots=True)
class AdmissionCounts:
    """Cumulative, in prompt tokens, first schedulings only (never a resume): the prefix cache's
    queries and hits, the same hits by where the KV was (gpu, cpu), and the CPU tier's own
    lookups (the prompt tokens past the GPU hits, and those found there: vLLM's external
    cache); and the preemptions."""

    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    cached_tokens_gpu: int = 0
    cached_tokens_cpu: int = 0
    cpu_cache_queries: int = 0
    cpu_cache_hits: int = 0
    num_preemptions: int = 0

    def hits(self, num_queried: int, num_on_gpu: int, num_on_cpu: int, cpu_tier: bool) -> None:
        self.prefix_cache_queries += num_queried
        self.prefix_cache_hits += num_on_gpu + num_on_cpu
        self.cached_tokens_gpu += num_on_gpu
        self.cached_tokens_cpu += num_on_cpu
        if cpu_tier:
            self.cpu_cache_queries += num_queried - num_on_gpu
            self.cpu_cache_hits += num_on_cpu

    def preempted(self) -> None:
        self.num_preemptions += 1


@dataclass(slots=True)
class Admission:
    """Admission and preemption over the scheduler's queues (module doc).

    `waiting` and `running` are the scheduler's lists, sorted by `queue_key`, and
    `awaiting_load` its map of running requests admitted on loads still landing (request id ->
    the load batch it waits for): all three are shared, changed in place, never replaced."""

    block_manager: BlockManager
    waiting: list[Request]
    running: list[Request]
    awaiting_load: dict[str, int]
    max_num_seqs: int
    counts: AdmissionCounts = field(default_factory=AdmissionCounts)

    def admit_waiting(self, step: StepDraft, join_through: int, ahead: bool) -> None:
        """Admit waiting requests in FairShare's order while the budget, the sequence slots,
        the free blocks and the shares allow. A request that finds no slot or too few blocks
        takes them from the largest holder where that evens the holdings out (not `ahead`:
        nothing is preempted then). `join_through`: the step waits for the load batches up to
        it (planned before the landing), so a request waiting for no later one computes in it."""
        while self.waiting and step.budget > 0:
            index = step.share.next_admission(self.waiting)
            if index is None:
                return  # after running out of blocks, it would only be preempted again
            request = self.waiting[index]
            if request.num_pending_tokens:
                return  # preempted with its token still in flight: it resumes once that is committed
            limit = step.share.cap(request, step.budget)
            if not limit:
                return  # its client request has had its share: it comes after the others' turn
            admitted, num_tokens = False, 0
            if len(self.running) < self.max_num_seqs:
                admitted, num_tokens = self._admit(index, limit, join_through)
            if not admitted:
                if ahead or not self._preempt_for(request, step):
                    return  # nobody overtakes a request that does not fit
                continue
            step.share.admitted(request)
            if num_tokens:  # 0: it waits for a load
                step.plan(request, num_tokens, self.block_manager.slot_table(request.request_id))

    def allocate_or_preempt(self, request: Request, num_tokens: int, step: StepDraft) -> bool:
        """Blocks for the request's next `num_tokens`, preempting running requests until they
        fit: the newest choice of the client request holding the most (FairShare.victim), its
        chunk dropped from the step if it had one. False when the request itself had to go."""
        num_tokens_covered = request.num_computed_tokens + num_tokens
        while not self.block_manager.allocate(request.request_id, num_tokens_covered):
            if self._preempt(step.share.victim(self.running), step) is request:
                return False
        return True

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

    def _preempt(self, index: int, step: StepDraft) -> Request:
        """Send `running[index]` back to waiting, its blocks released and its chunk of this
        step dropped; it recomputes what the prefix cache no longer holds when resumed."""
        request = self.running.pop(index)
        step.drop(request)
        step.share.preempted(request)
        self.awaiting_load.pop(request.request_id, None)
        self.block_manager.free(request.request_id)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.counts.preempted()
        insort(self.waiting, request, key=queue_key)
        return request

    def _admit(self, index: int, budget: int, join_through: int) -> tuple[bool, int]:
        """Move `waiting[index]` to running: (True, the tokens of its first chunk), or
        (True, 0) when it waits for a load this step; (False, 0) when it does not fit."""
        manager, request = self.block_manager, self.waiting[index]
        block_size = manager.block_size
        # The last token is always recomputed: its logits give the next token. Prompt
        # logprobs need every prompt position computed: such a request reads no cache.
        num_hashes = (request.num_tokens - 1) // block_size
        if request.params.prompt_logprobs is not None:
            num_hashes = 0
        cached = manager.look_up(request.block_hashes, num_hashes)
        num_cached = len(cached) * block_size
        num_tokens = min(request.num_tokens - num_cached, budget)
        num_on_gpu = cached.num_on_gpu * block_size  # before allocate loads them
        if not manager.allocate(request.request_id, num_cached + num_tokens, cached):
            return False, 0
        del self.waiting[index]
        if request.status == RequestStatus.WAITING:  # first scheduling; a resume is no hit
            request.num_cached_tokens = num_cached
            request.queued_s = time.monotonic() - request.received
            if manager.enable_prefix_caching:
                self.counts.hits(request.num_prompt_tokens, num_on_gpu, num_cached - num_on_gpu,
                                 cpu_tier=bool(manager.num_cpu_blocks))
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_cached
        insort(self.running, request, key=queue_key)
        awaited = manager.awaited_load_batch(request.request_id)
        if awaited > join_through:
            self.awaiting_load[request.request_id] = awaited
            return True, 0
        if awaited:
            manager.wait_for_loads_this_step()
        return True, num_tokens
