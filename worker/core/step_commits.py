"""The commit side of the scheduler: a step's tokens applied to its requests.

`Scheduler` (worker/core/scheduler.py) plans; what it inherits from `StepCommits` settles: the
counts of a step launched ahead of its tokens (`mark_in_flight`), then `update`, the one place
where tokens are committed (stop checks, thinking-budget state, block hashing, the release of
finished requests: now, or with the scheduler's `defer_release` once their last deltas are
sent, `release_finished`). It reads the scheduler's block manager, limits, eos ids and queues.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from spillway.protocol.hashing import block_hashes
from spillway.protocol.messages import FinishReason
from spillway.protocol.reasoning import advance
from spillway.worker.core.request import Request, RequestStatus, finished_status
from spillway.worker.core.step_plan import StepPlan, StepResult


class StepCommits:
    """`mark_in_flight`, `update` and the release of finished requests of `Scheduler` (module doc)."""

    def mark_in_flight(self, plan: StepPlan) -> None:
        """`plan` runs on the device and its tokens are not read yet: count its computed
        tokens and one pending token per sampling chunk, so `schedule(ahead=True)` can plan the
        step after it. `update(plan, ...)` with the tokens then settles them."""
        for chunk in plan.chunks:
            request = chunk.request
            if request.status == RequestStatus.RUNNING:
                request.num_computed_tokens = chunk.start + chunk.num_tokens
                request.num_pending_tokens = int(chunk.sample)

    def _last_token_is_pending(self, request: Request) -> bool:
        """Whether the pending token ends the request by length, whatever it is."""
        return (request.num_output_tokens + 1 >= request.params.max_tokens
                or request.num_tokens + 1 >= self.max_model_len)

    def update(self, plan: StepPlan, sampled: dict[str, int],
               accepted: Mapping[str, Sequence[int]] | None = None) -> list[StepResult]:
        """Apply a computed plan: `sampled` maps request id -> token for chunks with `sample`.

        `accepted`: for chunks with draft tokens, the drafts the verification accepted; they
        come before the sampled (recovered or bonus) token, and the run is committed token by
        token with every stop rule and the thinking budget, cut at the first that finishes."""
        results = []
        for chunk in plan.chunks:
            request = chunk.request
            if request.status != RequestStatus.RUNNING:
                continue  # aborted after schedule()
            request.num_computed_tokens = chunk.start + chunk.num_tokens
            if not chunk.sample:
                self._commit_full_blocks(request, chunk.start)
                continue
            request.num_pending_tokens = 0
            token = sampled[request.request_id]
            run = [*accepted[request.request_id], token] if accepted and request.request_id in accepted else [token]
            committed, reason = self._append_run(request, run)
            # Accepted drafts were computed in this forward; the last token of the run never is.
            request.num_computed_tokens += len(committed) - 1
            self._commit_full_blocks(request, chunk.start)
            if reason is not None:
                self._release(request, finished_status(reason), defer=self.defer_release)
            first = request.num_output_tokens == len(committed)
            results.append(StepResult(request, committed, reason, request.num_cached_tokens if first else -1,
                                      request.queued_s if first else -1.0))
        if any(result.finish_reason is not None for result in results):
            self.running = [request for request in self.running if not request.is_finished]
        return results

    def _append_run(self, request: Request, run: list[int]) -> tuple[list[int], FinishReason | None]:
        """Append the run's tokens up to the first that finishes the request."""
        for index, token in enumerate(run):
            request.append_token(token)
            if request.thinking_state is not None:
                request.thinking_state = advance(request.thinking_policy, request.thinking_state, token)[0]
            reason = self._finish_reason(request, token)
            if reason is not None:
                return run[: index + 1], reason
        return run, None

    def _hash_full_blocks(self, request: Request) -> None:
        hashes, size = request.block_hashes, self.block_size
        num_full = request.num_tokens // size
        if len(hashes) == num_full:
            return
        window = request.token_ids(len(hashes) * size, num_full * size)  # only the new blocks' ids
        if hashes:  # the chain goes on from the last hash (block_hashes' doc)
            hashes += block_hashes(window, size, hashes[-1])
        else:
            hashes += block_hashes(window, size, self.root_hash, request.cache_salt)

    def _commit_full_blocks(self, request: Request, chunk_start: int) -> None:
        """Cache the blocks this chunk completed (only computed blocks are ever committed)."""
        num_full = request.num_computed_tokens // self.block_size
        if not self.block_manager.enable_prefix_caching or num_full == chunk_start // self.block_size:
            return
        self._hash_full_blocks(request)
        self.block_manager.commit(request.request_id, request.block_hashes[:num_full])

    def _finish_reason(self, request: Request, token: int) -> FinishReason | None:
        params, num_outputs = request.params, request.num_output_tokens
        is_eos = token in self.eos_token_ids and not params.ignore_eos
        if num_outputs >= params.min_tokens and (is_eos or token in params.stop_token_ids):
            return FinishReason.STOP
        if num_outputs >= params.max_tokens or request.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _release(self, request: Request, status: RequestStatus, defer: bool = False) -> None:
        """Finish the request; its blocks are freed now, or with `defer` by `release_finished`."""
        self._awaiting_load.pop(request.request_id, None)
        request.status = status
        if defer:
            self._finished_holding.append(request.request_id)
        else:
            self.block_manager.free(request.request_id)
        del self._requests[request.request_id]
        sizes = self._parent_sizes
        sizes[request.parent_id] -= 1
        if not sizes[request.parent_id]:
            del sizes[request.parent_id]  # the share of the step goes to the client requests still held

    def release_finished(self) -> None:
        """Free the blocks of the requests finished with `defer_release` set."""
        for request_id in self._finished_holding:
            self.block_manager.free(request_id)
        self._finished_holding.clear()
