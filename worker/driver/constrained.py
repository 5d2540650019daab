"""Constrained requests (a `StructuredOutput` in their params) on their way in and at each step.

A constrained request waits here while its grammar compiles in the compiler's thread
(worker/sample/grammars.py), so a large schema never holds the busy loop; it joins the
scheduler once compiled, with its matcher on `Request.grammar`, or is answered with an error
naming what the library refused, or that the compile ran past `compile_timeout_s`
(`WorkerConfig.grammar_compile_timeout_s`).

At each step the engine asks `masks` for the sampled rows: one bitmask row per request past
its thinking (`Request.in_answer`) and not being forced, filled on the host while the device
runs the step's forward, sent in one copy (worker/sample/token_masks.py). Its mask needs the
token before it: a step that runs ahead with such a request (`Request.samples_after_commit`)
launches its forward, commits the step before (the grammars advance), then asks here and samples.
A request that step finished (its grammar complete, or at a dead end) gets no mask: its row's
token is dropped.
"""

from __future__ import annotations

import time
from concurrent import futures
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from spillway.protocol.messages import FinishReason, RequestDelta
from spillway.worker.core.request import Request
from spillway.protocol.reasoning import Phase, advance
from spillway.worker.sample.grammars import GrammarCompiler, RequestGrammar
from spillway.worker.sample.token_masks import HostBitmask, TokenMasks


@dataclass(slots=True)
class _Compiling:
    request: Request
    future: Future
    deadline: float


class ConstrainedRequests:
    def __init__(self, compiler: GrammarCompiler, max_num_seqs: int, device: torch.device,
                 compile_timeout_s: float) -> None:
        self.compiler = compiler
        self.compile_timeout_s = compile_timeout_s
        self._compiling: dict[str, _Compiling] = {}
        self._bitmask = HostBitmask(compiler.allocate_bitmask(max_num_seqs), device)

    def start(self, request: Request) -> tuple[Future, float]:
        """A compile of `request`'s grammar, begun now, and its deadline: for a request that
        must wait for something else first (its KV blocks), handed to `add` after."""
        return self.compiler.submit(request.params.structured), time.monotonic() + self.compile_timeout_s

    def add(self, request: Request, started: tuple[Future, float] | None = None) -> None:
        """`request` waits here until its grammar compiled: the compile `started` (`start`), or one begun now."""
        future, deadline = started or self.start(request)
        self._compiling[request.request_id] = _Compiling(request, future, deadline)

    @property
    def num_compiling(self) -> int:
        return len(self._compiling)

    def request_ids(self) -> list[str]:
        return list(self._compiling)

    def wait(self, timeout_s: float) -> None:
        """Until a compile finishes or `timeout_s` passes."""
        futures.wait([entry.future for entry in self._compiling.values()], timeout=timeout_s,
                     return_when=futures.FIRST_COMPLETED)

    def abort(self, request_ids: list[str]) -> list[Request]:
        """The requests of `request_ids` still compiling, dropped."""
        return [self._compiling.pop(request_id).request for request_id in request_ids if request_id in self._compiling]

    def ready(self) -> tuple[list[Request], list[RequestDelta]]:
        """Requests whose grammar compiled (their matcher set), and error deltas for those
        whose compile failed or ran out of time."""
        ready, refused = [], []
        now = time.monotonic()
        for request_id, entry in list(self._compiling.items()):
            if entry.future.done():
                del self._compiling[request_id]
                try:
                    entry.request.grammar = self.compiler.grammar(entry.future.result())
                except ValueError as error:
                    refused.append(_refusal(request_id, str(error)))
                    continue
                ready.append(entry.request)
            elif now > entry.deadline:
                del self._compiling[request_id]
                refused.append(_refusal(request_id, f"the {entry.request.params.structured.kind.value} constraint "
                                                    f"took longer than {self.compile_timeout_s:g} s to compile"))
        return ready, refused

    def masks(self, requests: list[Request]) -> TokenMasks | None:
        """The masks of `requests` (a step's sampled rows, in order), or None when none is
        constrained now."""
        rows = [row for row, request in enumerate(requests) if _masked(request)]
        if not rows:
            return None
        grammars = [requests[row].grammar for row in rows]
        return self._bitmask.send(rows, lambda bitmask, k: grammars[k].fill(bitmask, k))

    def draft_masks(self, verified: list[tuple[Request, tuple[int, ...]]]) -> TokenMasks | None:
        """The masks of a step that verifies drafts: `verified` holds each sampled request
        with its drafts, whose positions (1 + drafts each) are the logits' rows in order. A
        constrained position in the answer is masked as if the drafts before it were
        committed; the matcher walks through them and is rolled back. Past a draft the
        grammar refuses, the rows keep the mask before it: they are never used, since that
        draft gets no probability and verification stops there."""
        rows: list[int] = []
        fills: list[tuple] = []  # what `_fill_after_drafts` takes after the bitmask and row
        start = 0
        for request, drafts in verified:
            if request.grammar is not None:
                state = request.thinking_state
                for position in range(len(drafts) + 1):
                    if state is None or state.phase == Phase.ANSWER:
                        rows.append(start + position)
                        fills.append((request.grammar, position, drafts, request.thinking_state,
                                      request.thinking_policy))
                    if position < len(drafts) and state is not None:
                        state = advance(request.thinking_policy, state, drafts[position])[0]
            start += len(drafts) + 1
        if not rows:
            return None
        return self._bitmask.send(rows, lambda bitmask, k: _fill_after_drafts(bitmask, k, *fills[k]))

    def close(self) -> None:
        self.compiler.close()


def _fill_after_drafts(bitmask, row: int, grammar: RequestGrammar, position: int, drafts: tuple[int, ...],
                       state, policy) -> None:
    """Row `row` as the grammar stands after the answer's tokens among `drafts[:position]`."""
    walked = 0
    for token in drafts[:position]:
        in_answer = state is None or state.phase == Phase.ANSWER
        if state is not None:
            state = advance(policy, state, token)[0]
        if in_answer:
            if not grammar.accept(token):
                break
            walked += 1
    grammar.fill(bitmask, row)
    grammar.rollback(walked)


def _masked(request: Request) -> bool:
    # A forced token is never in the answer.
    return request.grammar is not None and request.in_answer and not request.is_finished


def _refusal(request_id: str, error: str) -> RequestDelta:
    return RequestDelta(request_id=request_id, new_token_ids=[], finish_reason=FinishReason.ERROR, error=error)
