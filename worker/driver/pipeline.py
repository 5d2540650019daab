"""The driver's side of one step: inputs packed from a plan, and the sampled tokens read back.

Every step takes one path:

    plan     Scheduler.schedule: chunks, run_ahead, KV copies          (worker/core/scheduler.py)
    inputs   pack_step: a PackedStep, plain data, no requests            (here)
    execute  Executor.execute: logits of the sampled chunks              (worker/runner/executor.py)
    sample   Sampler.sample_ids on the device; TokenReadback starts the copy to the host
             (with draft tokens: SpecDecoder.verify, worker/speculative/)
    commit   Scheduler.update: stop checks, thinking-budget state, block hashing

Asynchronous scheduling is "commit one step later". While the device runs step N, the
host plans step N+1; when that plan may run ahead (`StepPlan.run_ahead`: every token it
samples is chosen by the device alone, decodes and prompt chunks alike), N+1 is launched with
its decodes' input tokens fed from step N's sampled ids still on the device, and only then is
step N committed:

    host:    plan N | launch N | plan N+1 | launch N+1 | commit N | plan N+2 | ...
    device:         | ===== step N ===== | ===== step N+1 ===== | ...

A plan whose rows take grammar masks (`StepPlan.samples_after_commit`) runs ahead too, with
step N's commit between N+1's forward and its sampling: the masks need N's tokens.

    host:    plan N+1 | forward N+1 | commit N | masks, sample N+1 | plan N+2 | ...

A plan that may not run ahead waits: step N is committed first, then N+1 runs and is
committed at once. A request that step N finishes (EOS, a stop token) wastes one row of
N+1, whose token the commit drops; requests that N surely finishes by length are not
planned ahead. Outputs are the same with asynchronous scheduling on or off.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from spillway.kernels.host_copy import copy_by_kernel
from spillway.protocol.messages import TokenLogprobs
from spillway.worker.runner.executor import PackedStep
from spillway.worker.sample.logprobs import prompt_positions
from spillway.worker.runner.model_runner import ChunkInput
from spillway.worker.core.request import Request
from spillway.worker.core.step_plan import StepPlan


@dataclass(slots=True)
class LaunchedStep:
    """A step on the device whose sampled tokens the host has not committed yet."""

    plan: StepPlan
    token_ids: torch.Tensor | None  # int64 [sampled rows] on the device: the next step's feed
    # The same, being copied into pinned host memory; None: read token_ids when committed.
    host_tokens: torch.Tensor | None
    copied: torch.cuda.Event | None  # recorded after that copy; None on the CPU
    rows: dict[str, int]  # request id -> its row of token_ids
    # By request id, for the requests that asked: one entry per token of the request's run.
    logprobs: dict[str, list[TokenLogprobs]]
    # Request id -> draft tokens accepted before its sampled token (worker/speculative/); empty
    # without speculation. Such a step is committed at once (never run ahead).
    accepted: dict[str, list[int]] = field(default_factory=dict)

    def finished(self) -> bool:
        """Whether the device has produced the step's tokens (reading them will not wait).
        False on the CPU, where a step is done when it returns and nothing runs ahead."""
        return self.copied is not None and self.copied.query()

    def read(self) -> dict[str, int]:
        """Request id -> sampled token; waits for the copy."""
        if self.token_ids is None:
            return {}
        if self.host_tokens is None:  # committed at once: one plain read
            return dict(zip(self.rows, self.token_ids.tolist()))
        if self.copied is not None:
            self.copied.synchronize()
        return dict(zip(self.rows, self.host_tokens.tolist()))


def pack_step(plan: StepPlan, previous: LaunchedStep | None) -> PackedStep:
    """The executor's input for `plan`; a request's pending token is fed from `previous`."""
    chunks: list[ChunkInput] = []
    feed_rows: list[int] = []
    feed_sources: list[int] = []
    sample_rows: list[int] = []
    logits_rows: list[int] = []  # with draft tokens: every sampled chunk's verified rows
    prompt_rows: list[int] = []  # rows scoring prompt tokens (prompt_logprobs)
    verifies = any(chunk.draft_token_ids for chunk in plan.chunks)
    prompt_rows_wanted = any(prompt_positions(chunk) for chunk in plan.chunks)
    num_rows = 0
    for row, chunk in enumerate(plan.chunks):
        request = chunk.request
        if request.num_pending_tokens:
            assert previous is not None, "a pending token without a step in flight"
            feed_rows.append(row)
            feed_sources.append(previous.rows[request.request_id])
            token_ids = [0]  # a placeholder: the feed overwrites it on the device
        else:
            token_ids = request.token_ids(chunk.start, chunk.start + chunk.num_tokens)
        if chunk.draft_token_ids:
            assert chunk.sample and len(chunk.draft_token_ids) <= chunk.num_draft_slots
            token_ids = token_ids + list(chunk.draft_token_ids)
        chunks.append(ChunkInput(token_ids, chunk.start, chunk.slot_table))
        prompt_rows.extend(num_rows + p - chunk.start for p in prompt_positions(chunk))
        num_rows += len(token_ids)
        if chunk.sample:
            sample_rows.append(row)
            if verifies or prompt_rows_wanted:
                logits_rows.extend(range(num_rows - 1 - len(chunk.draft_token_ids), num_rows))
    # Drafts follow committed tokens only (Engine.step commits the step in flight first).
    assert not (verifies and feed_rows), "a step with drafts takes no tokens from the device"
    return PackedStep(chunks, feed_rows, feed_sources, sample_rows, plan.kv_copies,
                      logits_rows + prompt_rows, len(prompt_rows))


class TokenReadback:
    """Copies of sampled ids to pinned host memory, two buffers used in turn: the copy of
    step N+1 may land while the host still reads step N's."""

    def __init__(self, max_num_seqs: int, device: torch.device, by_kernel: bool = False) -> None:
        """`by_kernel`: copy with a kernel, not a copy engine (kernels/host_copy.py), where the
        CPU tier's stores keep the device-to-host copy engine busy."""
        on_cuda = device.type == "cuda"
        self._buffers = [torch.empty(max_num_seqs, dtype=torch.int64, pin_memory=on_cuda) for _ in range(2)]
        self._events = [torch.cuda.Event() for _ in range(2)] if on_cuda else None
        self._turn = 0
        self._by_kernel = by_kernel

    def start(self, plan: StepPlan, requests: list[Request], token_ids: torch.Tensor | None,
              logprobs: dict[str, list[TokenLogprobs]], ahead: bool) -> LaunchedStep:
        """Start reading `token_ids` (row i: `requests[i]`'s token; None: nothing sampled).
        Only a step that runs `ahead` (committed one step later) needs the asynchronous copy."""
        rows = {request.request_id: row for row, request in enumerate(requests)}
        if token_ids is None or not ahead:
            return LaunchedStep(plan, token_ids, None, None, rows, logprobs)
        self._turn ^= 1
        host = self._buffers[self._turn][: token_ids.shape[0]]
        if self._by_kernel and token_ids.dtype == host.dtype and token_ids.is_contiguous():
            copy_by_kernel(host, token_ids)
        else:
            host.copy_(token_ids, non_blocking=True)
        event = None
        if self._events is not None:
            event = self._events[self._turn]
            event.record()
        return LaunchedStep(plan, token_ids, host, event, rows, logprobs)
