"""Log-probabilities from raw logits: of sampled tokens (the sampler's), and of prompt tokens
(`prompt_logprobs`, vLLM's: how likely the model found each prompt token after the first).

A chunk's row for position p scores the token at p + 1, so a request that asked for prompt
logprobs has its prompt rows (positions 0 .. num_prompt - 2) read as well as its sample row:

    prompt      t0   t1   t2   t3 | sampled
    row (pos)   0    1    2    3
    scores      t1   t2   t3   ── the sample row: the first output token

Such a request reads no prefix cache (every prompt position is computed), and the entries
are kept on the request until its first delta carries them. A recomputed prompt (after a
preemption) does not append them twice.
"""

from __future__ import annotations

import torch
from torch import Tensor

from spillway.protocol.messages import TokenLogprobs
from spillway.worker.core.request import Request
from spillway.worker.core.step_plan import ScheduledChunk, StepPlan


def token_logprobs(logits: Tensor, token_ids: Tensor, num_top: list[int]) -> list[TokenLogprobs]:
    """Row i: the logprob and rank of `token_ids[i]` under `logits[i]`'s log-softmax, and the
    `num_top[i]` most likely tokens. Reads the result on the host."""
    logprobs = logits.float().log_softmax(dim=-1)
    chosen = token_ids.long().unsqueeze(1)
    chosen_logprobs = logprobs.gather(1, chosen)
    ranks = (logprobs > chosen_logprobs).sum(dim=-1) + 1
    top_logprobs, top_ids = logprobs.topk(min(max(num_top), logprobs.shape[-1]), dim=-1)
    rows = zip(chosen.squeeze(1).tolist(), chosen_logprobs.squeeze(1).tolist(), ranks.tolist(),
               top_ids.tolist(), top_logprobs.tolist(), num_top)
    return [TokenLogprobs(token_id, logprob, rank, ids[:n], top[:n]) for token_id, logprob, rank, ids, top, n in rows]


def prompt_positions(chunk: ScheduledChunk) -> range:
    """The chunk's positions whose next token is a prompt token, for a request that asked."""
    request = chunk.request
    if request.params.prompt_logprobs is None:
        return range(0)
    return range(chunk.start, min(chunk.start + chunk.num_tokens, request.num_prompt_tokens - 1))


def record_prompt_logprobs(plan: StepPlan, logits: Tensor) -> None:
    """`logits`: one row per prompt position of the plan's chunks, in chunk order (the rows
    `pack_step` asked for). Appends each request's new entries to `request.prompt_logprobs`."""
    spans = [(chunk, prompt_positions(chunk)) for chunk in plan.chunks]
    spans = [(chunk, positions) for chunk, positions in spans if positions]
    targets = [chunk.request.all_token_ids[p + 1] for chunk, positions in spans for p in positions]
    num_top = [chunk.request.params.prompt_logprobs for chunk, positions in spans for _ in positions]
    entries = token_logprobs(logits, torch.tensor(targets, device=logits.device), num_top)
    offset = 0
    for chunk, positions in spans:
        recorded = chunk.request.prompt_logprobs
        new = entries[offset:offset + len(positions)]
        offset += len(positions)
        recorded.extend(new[max(0, len(recorded) - positions.start):])


def first_delta_prompt_logprobs(request: Request, num_cached_tokens: int) -> list[TokenLogprobs] | None:
    """What a delta carries of the prompt's logprobs: all of them on the request's first delta
    (the one that reports its cached tokens), when it asked; else None."""
    if request.params.prompt_logprobs is None or num_cached_tokens < 0:
        return None
    return request.prompt_logprobs
