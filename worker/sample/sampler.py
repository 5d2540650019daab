"""Choosing the next token of every request in a batch from the model's logits.

One step, for float32 logits [batch, vocab]:

    raw logits ──► grammar masks ──► penalties ──► min_tokens mask ──┬─► greedy rows: argmax
        │                                                            └─► sampled rows: / temperature
        │                                    ─► top-k ─► top-p ─► min-p ─► softmax ─► draw
        └─► logprobs (log_softmax of the raw logits, vLLM's default)

Grammar masks (worker/sample/token_masks.py) leave a constrained row only the tokens its
grammar allows next.

Drawing is argmax(probs / q) with q ~ Exponential(1), which picks token i with probability
probs[i]. A request with a seed draws its q from its own generator, so its tokens depend only
on its seed and its logits, never on its neighbours in the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from spillway.protocol.messages import SamplingParams, TokenLogprobs
from spillway.worker.sample.logprobs import token_logprobs
from spillway.worker.sample.token_masks import TokenMasks
from spillway.worker.core.request import has_penalties

__all__ = ["Sampler", "SamplingInput", "SampledToken", "has_penalties", "is_plain_greedy",
           "adjusted_logits", "apply_penalties", "filtered_logits", "mask_stop_tokens"]


@dataclass(slots=True)
class SamplingInput:
    """One request's row of the logits, with what the sampler needs to know about it."""

    request_id: str
    params: SamplingParams
    prompt_token_ids: Sequence[int]  # `Request.sampling_prompt`: a list where penalties read it
    output_token_ids: Sequence[int]  # read during the step only: the request's list may be live
    # Set while a thinking budget closes thinking: this token is produced whatever the logits.
    forced_token_id: int | None = None


@dataclass(slots=True)
class SampledToken:
    token_id: int
    logprobs: TokenLogprobs | None = None


def needs_min_tokens_mask(sampling_input: SamplingInput) -> bool:
    return len(sampling_input.output_token_ids) < sampling_input.params.min_tokens


def is_plain_greedy(sampling_input: SamplingInput) -> bool:
    """A row whose token is the argmax of the raw logits and that wants nothing else."""
    params = sampling_input.params
    return (params.greedy and not has_penalties(params) and params.logprobs is None
            and not needs_min_tokens_mask(sampling_input))


def apply_penalties(logits: Tensor, inputs: Sequence[SamplingInput]) -> Tensor:
    """Repetition, then frequency, then presence penalties, as vLLM applies them.

    Repetition counts tokens of the prompt or the output; frequency and presence only the
    output. Returns a new tensor; `logits` is left as it was.
    """
    output_rows: list[int] = []
    output_cols: list[int] = []
    prompt_rows: list[int] = []
    prompt_cols: list[int] = []
    for row, sampling_input in enumerate(inputs):
        if not has_penalties(sampling_input.params):
            continue
        output_rows += [row] * len(sampling_input.output_token_ids)
        output_cols += sampling_input.output_token_ids
        if sampling_input.params.repetition_penalty != 1.0:
            prompt_rows += [row] * len(sampling_input.prompt_token_ids)
            prompt_cols += sampling_input.prompt_token_ids

    device = logits.device
    output_counts = torch.zeros_like(logits)
    if output_rows:
        index = (torch.tensor(output_rows, device=device), torch.tensor(output_cols, device=device))
        output_counts.index_put_(index, torch.ones(len(output_rows), device=device), accumulate=True)
    in_output = output_counts > 0
    seen = in_output.clone()
    if prompt_rows:
        seen[torch.tensor(prompt_rows, device=device), torch.tensor(prompt_cols, device=device)] = True

    def column(values: list[float]) -> Tensor:
        return torch.tensor(values, dtype=logits.dtype, device=device).unsqueeze(1)

    repetition = torch.where(seen, column([i.params.repetition_penalty for i in inputs]), 1.0)
    logits = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = logits - column([i.params.frequency_penalty for i in inputs]) * output_counts
    return logits - column([i.params.presence_penalty for i in inputs]) * in_output


def mask_stop_tokens(logits: Tensor, inputs: Sequence[SamplingInput],
                     eos_token_ids: Sequence[int]) -> Tensor:
    """-inf on EOS and stop token ids for rows that have not yet reached min_tokens."""
    rows: list[int] = []
    cols: list[int] = []
    for row, sampling_input in enumerate(inputs):
        if needs_min_tokens_mask(sampling_input):
            stop_ids = [*eos_token_ids, *sampling_input.params.stop_token_ids]
            rows += [row] * len(stop_ids)
            cols += stop_ids
    if not rows:
        return logits
    device = logits.device
    index = (torch.tensor(rows, device=device), torch.tensor(cols, device=device))
    return logits.index_put(index, torch.tensor(float("-inf"), device=device))


def adjusted_logits(logits: Tensor, inputs: Sequence[SamplingInput],
                    eos_token_ids: Sequence[int]) -> Tensor:
    """The logits that greedy picks from and sampling starts from: penalties, then masks."""
    if any(has_penalties(i.params) for i in inputs):
        # Extreme penalties must not turn a logit into inf or NaN.
        finite = torch.finfo(logits.dtype).max
        logits = apply_penalties(logits, inputs).nan_to_num(nan=-finite, posinf=finite, neginf=-finite)
    return mask_stop_tokens(logits, inputs, eos_token_ids)


def filtered_logits(logits: Tensor, params: Sequence[SamplingParams]) -> Tensor:
    """Temperature, then top-k, then top-p, then min-p, row by row; dropped tokens get -inf.

    Every row must be a sampled (temperature > 0) row. softmax of the result is the
    distribution each row draws from.
    """
    assert all(not p.greedy for p in params), "greedy rows are not filtered"
    device, vocab_size = logits.device, logits.shape[-1]

    def per_row(values: list, dtype: torch.dtype = logits.dtype) -> Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    logits = logits / per_row([p.temperature for p in params]).unsqueeze(1)
    top_k = None
    if any(p.top_k > 0 for p in params):
        top_k = per_row([min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size for p in params],
                        torch.long)
    top_p = per_row([p.top_p for p in params]) if any(p.top_p < 1.0 for p in params) else None
    if top_k is not None or top_p is not None:
        logits = _apply_top_k_top_p(logits, top_k, top_p)
    if any(p.min_p > 0.0 for p in params):
        logits = _apply_min_p(logits, per_row([p.min_p for p in params]))
    return logits


def _apply_top_k_top_p(logits: Tensor, top_k: Tensor | None, top_p: Tensor | None) -> Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
    if top_k is not None:
        # Keeps every token tied with the k-th largest, as vLLM does.
        kth_largest = sorted_logits.gather(1, (top_k - 1).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth_largest, float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        mass_before = F.pad(probs.cumsum(dim=-1)[:, :-1], (1, 0))
        # top_p == 1 keeps everything, even where the cumulative sum rounds up to 1 early.
        drop = (mass_before >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _apply_min_p(logits: Tensor, min_p: Tensor) -> Tensor:
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, float("-inf"))


class Sampler:
    """Picks one token per row of a logits batch; keeps the generators of seeded requests.

    A seeded request's generator is created on its first step and advanced once per sampled
    step until `forget`, so the same seed and logits give the same tokens in any batch.
    Requests without a seed share one generator seeded from `seed`.
    """

    def __init__(self, eos_token_ids: Sequence[int], seed: int = 0,
                 device: str | torch.device = "cpu"):
        self.eos_token_ids = tuple(eos_token_ids)
        self.device = torch.device(device)
        self.shared_generator = torch.Generator(device=self.device)
        self.shared_generator.manual_seed(seed)
        self.request_generators: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        self.request_generators.pop(request_id, None)

    def sample(self, logits: Tensor, inputs: list[SamplingInput], masks: TokenMasks | None = None
               ) -> list[SampledToken]:
        assert logits.dim() == 2 and logits.shape[0] == len(inputs), (logits.shape, len(inputs))
        if masks is None and all(is_plain_greedy(i) for i in inputs):
            token_list = logits.argmax(dim=-1).tolist()
            return [SampledToken(token_id if i.forced_token_id is None else i.forced_token_id)
                    for token_id, i in zip(token_list, inputs)]
        token_ids = self.sample_ids(logits, inputs, masks)
        logprobs = self.logprobs(logits, inputs, token_ids)
        return [SampledToken(token_id, logprobs.get(row))
                for row, token_id in enumerate(token_ids.tolist())]

    def sample_ids(self, logits: Tensor, inputs: list[SamplingInput], masks: TokenMasks | None = None) -> Tensor:
        """The chosen token of every row, int64 on the logits' device, read by no host code:
        the tokens of `sample` without logprobs, in the same generator order. `masks`: the
        constrained rows' allowed tokens (worker/sample/token_masks.py), applied first."""
        assert logits.dim() == 2 and logits.shape[0] == len(inputs), (logits.shape, len(inputs))
        if masks is not None:
            logits = masks.apply(logits)
        if all(is_plain_greedy(i) for i in inputs):
            token_ids = logits.argmax(dim=-1)
        else:
            adjusted = adjusted_logits(logits, inputs, self.eos_token_ids)
            sampled_rows = [row for row, i in enumerate(inputs) if not i.params.greedy]
            if len(sampled_rows) == len(inputs):
                token_ids = self._draw(adjusted, inputs)
            else:
                token_ids = adjusted.argmax(dim=-1)
                if sampled_rows:
                    rows = torch.tensor(sampled_rows, device=logits.device)
                    token_ids[rows] = self._draw(adjusted[rows], [inputs[r] for r in sampled_rows])
        for row, sampling_input in enumerate(inputs):
            if sampling_input.forced_token_id is not None:
                token_ids[row] = sampling_input.forced_token_id
        return token_ids

    def _draw(self, logits: Tensor, inputs: list[SamplingInput]) -> Tensor:
        probs = filtered_logits(logits, [i.params for i in inputs]).softmax(dim=-1)
        noise = self._exponential_noise(inputs, probs.shape[-1], probs.device)
        return (probs / noise).argmax(dim=-1)

    def _exponential_noise(self, inputs: list[SamplingInput], vocab_size: int,
                           device: torch.device) -> Tensor:
        noise = torch.empty(len(inputs), vocab_size, device=device)
        shared_rows = [row for row, i in enumerate(inputs) if i.params.seed is None]
        if len(shared_rows) == len(inputs):
            noise.exponential_(generator=self.shared_generator)
        elif shared_rows:
            block = torch.empty(len(shared_rows), vocab_size, device=device)
            noise[torch.tensor(shared_rows, device=device)] = block.exponential_(
                generator=self.shared_generator)
        for row, sampling_input in enumerate(inputs):
            if sampling_input.params.seed is not None:
                noise[row].exponential_(generator=self.generator_for(sampling_input))
        # A zero draw would turn a dropped token's 0 / q into NaN, which argmax prefers.
        return noise.clamp_min_(torch.finfo(noise.dtype).tiny)

    def generator_for(self, sampling_input: SamplingInput) -> torch.Generator:
        generator = self.request_generators.get(sampling_input.request_id)
        if generator is None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(sampling_input.params.seed)
            self.request_generators[sampling_input.request_id] = generator
        return generator

    def logprobs(self, logits: Tensor, inputs: list[SamplingInput],
                 token_ids: Tensor) -> dict[int, TokenLogprobs]:
        """TokenLogprobs by row, for the rows that asked, from the raw logits (reads them on
        the host: only steps with such rows wait for it)."""
        rows = [row for row, i in enumerate(inputs) if i.params.logprobs is not None]
        if not rows:
            return {}
        row_index = torch.tensor(rows, device=logits.device)
        entries = token_logprobs(logits[row_index], token_ids[row_index], [inputs[r].params.logprobs for r in rows])
        return dict(zip(rows, entries))
