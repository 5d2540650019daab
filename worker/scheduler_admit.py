"""The admission side of the scheduler: the head of the waiting queue moved to running, on its
prefix-cache hits, and the hits counted.

`Scheduler` (worker/scheduler.py) inherits `_admit` from `Admission`: a lookup of the request's
block hashes (GPU, then the CPU tier), the blocks for its hits and its first chunk, and, when a
hit still has to load, no chunk this step (it computes once its load batch has landed). It
reads the scheduler's block manager, queues and counters. `queue_key` orders both queues.
"""

from __future__ import annotations

import time
from bisect import insort

from spillway.worker.request import Request, RequestStatus
from spillway.worker.step_plan import ScheduledChunk


def queue_key(request: Request) -> tuple[int, int]:
    """The order of the waiting and running queues: priority, then arrival (FCFS)."""
    return (request.priority, request.arrival_index)


class Admission:
    """`_admit` and `_count_hits` of `Scheduler` (module doc)."""

    def _admit(self, request: Request, budget: int, join_through: int = 0) -> tuple[bool, ScheduledChunk | None]:
        """Move the head of the waiting queue to running: (True, its first chunk), or
        (True, None) when it waits for a load this step; (False, None) when it does not fit.
        `join_through`: the step waits for the load batches up to it (planned before the
        landing), so a request waiting for no later one computes in it."""
        manager = self.block_manager
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
        self.waiting.pop(0)
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
            manager.tier.wait_for_loads_this_step()
        return True, self._chunk(request, num_tokens)

    def _count_hits(self, num_queried: int, num_on_gpu: int, num_on_cpu: int) -> None:
        self.prefix_cache_queries += num_queried
        self.prefix_cache_hits += num_on_gpu + num_on_cpu
        self.cached_tokens_gpu += num_on_gpu
        self.cached_tokens_cpu += num_on_cpu
        if self.block_manager.tier is not None:
            self.cpu_cache_queries += num_queried - num_on_gpu
            self.cpu_cache_hits += num_on_cpu
