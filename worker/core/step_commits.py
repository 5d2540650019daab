"""A step's tokens applied to its requests: the scheduler plans, `StepCommits` settles.

`mark_in_flight` counts the tokens of a step launched ahead of them; `StepCommits.commit` is the
one place where tokens are committed (stop checks, thinking-budget state, block hashing and the
prefix cache's commits). Releasing what finished is the scheduler's (worker/core/scheduler.py),
which holds the requests.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from spillway.protocol.hashing import block_hashes
from spillway.protocol.messages import BlockHash, FinishReason
from spillway.protocol.reasoning import advance
from spillway.worker.core.block_manager import BlockManager
from spillway.worker.core.request import Request, RequestStatus
from spillway.worker.core.step_plan import StepPlan, StepResult


def mark_in_flight(plan: StepPlan) -> None:
    """`plan` runs on the device and its tokens are not read yet: count its computed tokens
    and one pending token per sampling chunk, so the step after it can be planned.
    `StepCommits.commit(plan, ...)` with the tokens then settles them."""
    for chunk in plan.chunks:
        request = chunk.request
        if request.status == RequestStatus.RUNNING:
            request.num_computed_tokens = chunk.start + chunk.num_tokens
            request.num_pending_tokens = int(chunk.sample)


@dataclass(slots=True)
class StepCommits:
    """Commits sampled tokens to their requests under the stop rules, and full computed blocks
    to the prefix cache (module doc)."""

    block_manager: BlockManager
    max_model_len: int
    root_hash: BlockHash
    eos_token_ids: frozenset[int]

    def commit(self, plan: StepPlan, sampled: dict[str, int],
               accepted: Mapping[str, Sequence[int]] | None = None) -> list[StepResult]:
        """Apply a computed plan: `sampled` maps request id -> token for chunks with `sample`.
        A result with a finish reason is a request that the caller releases.

        `accepted`: for chunks with draft tokens, the drafts the verification accepted; they
        come before the sampled (recovered or bonus) token, and the run is committed token by
        token with every stop rule and the thinking budget, cut at the first that finishes."""
        results = []
        for chunk in plan.chunks:
            request = chunk.request
            if request.status == RequestStatus.PREEMPTED and chunk.sample and request.num_pending_tokens:
                results.append(self._commit_preempted(request, sampled[request.request_id]))
                continue
            if request.status != RequestStatus.RUNNING:
                continue  # aborted after schedule(), or preempted with no token to come
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
            first = request.num_output_tokens == len(committed)
            results.append(StepResult(request, committed, reason, request.num_cached_tokens if first else -1,
                                      request.queued_s if first else -1.0))
        return results

    def _commit_preempted(self, request: Request, token: int) -> StepResult:
        """The token of a step that ran ahead, for a request preempted since (its blocks are
        gone and it recomputes from scratch when resumed): kept, as any step's token, under
        the stop rules. A seeded request's generator drew it: dropping it would change what
        the seed gives."""
        request.num_pending_tokens = 0
        committed, reason = self._append_run(request, [token])
        first = request.num_output_tokens == len(committed)
        return StepResult(request, committed, reason, request.num_cached_tokens if first else -1,
                          request.queued_s if first else -1.0)

    def hash_full_blocks(self, request: Request) -> None:
        """Extend the request's block hashes over its full blocks not hashed yet."""
        hashes, size = request.block_hashes, self.block_manager.block_size
        num_full = request.num_tokens // size
        if len(hashes) == num_full:
            return
        window = request.token_ids(len(hashes) * size, num_full * size)  # only the new blocks' ids
        if hashes:  # the chain goes on from the last hash (block_hashes' doc)
            hashes += block_hashes(window, size, hashes[-1])
        else:
            hashes += block_hashes(window, size, self.root_hash, request.cache_salt)

    def _append_run(self, request: Request, run: list[int]) -> tuple[list[int], FinishReason | None]:
        """Append the run's tokens up to the first that finishes the request."""
        for index, token in enumerate(run):
            constrained = request.grammar is not None and request.in_answer
            request.append_token(token)
            if request.thinking_state is not None:
                request.thinking_state = advance(request.thinking_policy, request.thinking_state, token)[0]
            reason = self._finish_reason(request, token)
            if constrained and reason is None:
                reason = _grammar_finish(request.grammar, token)
            if reason is not None:
                return run[: index + 1], reason
        return run, None

    def _commit_full_blocks(self, request: Request, chunk_start: int) -> None:
        """Cache the blocks this chunk completed (only computed blocks are ever committed)."""
        manager = self.block_manager
        num_full = request.num_computed_tokens // manager.block_size
        if not manager.enable_prefix_caching or num_full == chunk_start // manager.block_size:
            return
        self.hash_full_blocks(request)
        manager.commit(request.request_id, request.block_hashes[:num_full])

    def _finish_reason(self, request: Request, token: int) -> FinishReason | None:
        params, num_outputs = request.params, request.num_output_tokens
        is_eos = token in self.eos_token_ids and not params.ignore_eos
        if num_outputs >= params.min_tokens and (is_eos or token in params.stop_token_ids):
            return FinishReason.STOP
        if num_outputs >= params.max_tokens or request.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None


def _grammar_finish(grammar, token: int) -> FinishReason | None:
    """A constrained answer ends where its grammar is complete and takes the stop token (under
    ignore_eos too: nothing may follow), or where a token leaves it (a dead end: the masks
    allow none of the tokens the model could still produce)."""
    if not grammar.accept(token) or grammar.is_terminated():
        return FinishReason.STOP
    return None
