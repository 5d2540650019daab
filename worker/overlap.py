"""Asynchronous scheduling: the host plans step N+1 while the device still runs step N.

Without it, the device idles while the host reads step N's tokens, updates the requests,
schedules and stages step N+1. With it, a decode step is launched before the tokens of
the step before are read:

    host:    schedule N | launch N | schedule N+1 (ahead) | launch N+1 | read N, update | ...
    device:             | ===== step N ===== | ===== step N+1 ===== | ...

Step N+1's input token of each request comes from step N's sampled ids on the device
(`TokenFeed`); the scheduler counts that token as pending (`Scheduler.mark_in_flight`).
A request that step N finishes (EOS, a stop token) has one wasted row in step N+1, whose
token is dropped. Requests that step N surely finishes by length are not scheduled ahead.

Only steps of one-token decodes whose tokens the sampler can choose on the device without
history overlap: no logprobs, no penalties, no thinking budget, min_tokens reached. Any
other step waits for the tokens first and runs as before, so outputs are the same with
the feature on or off (the tests compare them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spillway.worker.model_runner import ChunkInput, TokenFeed
from spillway.worker.request import RequestStatus
from spillway.worker.sampler import has_penalties
from spillway.worker.scheduler import StepPlan


@dataclass(slots=True)
class InFlightStep:
    """A launched step whose sampled tokens the host has not read yet."""

    plan: StepPlan
    token_ids: torch.Tensor  # int64 [len(plan.chunks)] on the device: the feed of the next step
    host_tokens: torch.Tensor  # the same, being copied into pinned host memory
    copied: torch.cuda.Event | None  # recorded after that copy; None on the CPU
    rows: dict[str, int]  # request id -> its row

    def read(self) -> dict[str, int]:
        """Request id -> sampled token; waits for the copy."""
        if self.copied is not None:
            self.copied.synchronize()
        return dict(zip(self.rows, self.host_tokens.tolist()))


def can_overlap(plan: StepPlan) -> bool:
    """Whether every chunk is a one-token decode whose token the device can choose alone."""
    for chunk in plan.chunks:
        request, params = chunk.request, chunk.request.params
        if chunk.num_tokens != 1 or not chunk.sample or request.status != RequestStatus.RUNNING:
            return False
        if params.logprobs is not None or has_penalties(params) or request.thinking_state is not None:
            return False
        if request.num_output_tokens < params.min_tokens:
            return False
    return bool(plan.chunks)


def chunk_inputs(plan: StepPlan, previous: InFlightStep | None) -> tuple[list[ChunkInput], TokenFeed | None]:
    """The runner's chunks; a request's pending token is fed from `previous` on the device."""
    chunks: list[ChunkInput] = []
    rows: list[int] = []
    sources: list[int] = []
    for row, chunk in enumerate(plan.chunks):
        request = chunk.request
        if request.num_pending_tokens:
            assert previous is not None, "a pending token without a step in flight"
            rows.append(row)
            sources.append(previous.rows[request.request_id])
            token_ids = [0]  # a placeholder: the feed overwrites it on the device
        else:
            token_ids = request.all_token_ids[chunk.start:chunk.start + chunk.num_tokens]
        chunks.append(ChunkInput(token_ids, chunk.start, chunk.block_table))
    feed = TokenFeed(rows, sources, previous.token_ids) if rows else None
    return chunks, feed


class TokenReadback:
    """Copies of sampled ids to pinned host memory, two buffers used in turn: the copy of
    step N+1 may land while the host still reads step N's."""

    def __init__(self, max_num_seqs: int, device: torch.device) -> None:
        on_cuda = device.type == "cuda"
        self._buffers = [torch.empty(max_num_seqs, dtype=torch.int64, pin_memory=on_cuda) for _ in range(2)]
        self._events = [torch.cuda.Event() for _ in range(2)] if on_cuda else None
        self._turn = 0

    def start(self, plan: StepPlan, token_ids: torch.Tensor) -> InFlightStep:
        self._turn ^= 1
        host = self._buffers[self._turn][: token_ids.shape[0]]
        host.copy_(token_ids, non_blocking=True)
        event = None
        if self._events is not None:
            event = self._events[self._turn]
            event.record()
        rows = {chunk.request.request_id: row for row, chunk in enumerate(plan.chunks)}
        return InFlightStep(plan, token_ids, host, event, rows)
