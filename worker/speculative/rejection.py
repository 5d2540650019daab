"""Exact verification of draft tokens: rejection sampling over the target's k + 1 rows.

Names as in the papers (Leviathan et al. 2023, Chen et al. 2023): p is the target's
distribution, q the draft's. For each request, draft token d_j (drawn from q_j) is accepted
with probability min(1, p_j(d_j) / q_j(d_j)), in order, up to the first rejection. At the
first rejected position a token is drawn from the residual max(p_a - q_a, 0), normalised
(the "recovered" token); after a full accept a "bonus" token is drawn from p_k. The
committed run, accepted drafts then that token, has exactly the target's distribution.

A greedy request's p is a point mass at the argmax, so it accepts while the draft equals
the argmax and then takes the argmax: the tokens of plain greedy decoding. A proposer that
draws deterministically (n-gram lookup, replay) has q a point mass at its draft.

Rows come flattened: request i owns rows offsets[i] .. offsets[i] + num_drafts[i], one per
position. Each row's p already holds the sampler's rules for that position (penalties over
the outputs so far, the min_tokens mask, a forced thinking-budget token: see
worker/speculative/decoder.py). The work is vectorised over a padded [requests, k + 1] layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from spillway.worker.sample.sampler import Sampler, SamplingInput, adjusted_logits, filtered_logits, is_plain_greedy


@dataclass(slots=True)
class Verified:
    """One verification's outcome (on the device, or on the host from `verify_argmax`): read
    by the commit only."""

    num_accepted: Tensor  # int64 [requests]
    token_ids: Tensor  # int64 [requests]: the recovered or bonus token of each request


def target_probs(logits: Tensor, inputs: Sequence[SamplingInput], eos_token_ids: Sequence[int]) -> Tensor:
    """p of every row: float32 [rows, vocab]; a point mass for greedy and forced rows."""
    if all(is_plain_greedy(i) for i in inputs):
        adjusted = logits
    else:
        adjusted = adjusted_logits(logits, inputs, eos_token_ids)
    probs = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
    sampled_rows = [row for row, i in enumerate(inputs) if not i.params.greedy and i.forced_token_id is None]
    point_rows = [row for row, i in enumerate(inputs) if i.params.greedy or i.forced_token_id is not None]
    if sampled_rows:
        index = torch.tensor(sampled_rows, device=logits.device)
        filtered = filtered_logits(adjusted[index], [inputs[row].params for row in sampled_rows])
        probs[index] = filtered.float().softmax(dim=-1)
    if point_rows:
        index = torch.tensor(point_rows, device=logits.device)
        chosen = adjusted[index].argmax(dim=-1)
        forced = [(j, inputs[row].forced_token_id) for j, row in enumerate(point_rows)
                  if inputs[row].forced_token_id is not None]
        if forced:
            positions, token_ids = zip(*forced)
            chosen[list(positions)] = torch.tensor(token_ids, device=logits.device)
        probs[index, chosen] = 1.0
    return probs


class RejectionSampler:
    """Verifies a batch of drafted requests; random numbers come from the sampler's
    generators (a seeded request's own, else the shared one), so seeds are honoured."""

    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler

    def verify(self, probs: Tensor, requests: Sequence[SamplingInput], num_drafts: Sequence[int],
               draft_token_ids: Sequence[int], draft_probs: Tensor | None = None) -> Verified:
        """`probs`: the target's p per row (`target_probs`), rows flattened per request.
        `requests`: one input per request (its params and seed). `draft_token_ids`: the drafts,
        flattened. `draft_probs`: q of each draft row, float32 [len(draft_token_ids), vocab];
        None: every draft is a point mass."""
        device, vocab_size = probs.device, probs.shape[-1]
        num_requests, max_drafts = len(num_drafts), max(num_drafts, default=0)
        drafts = torch.tensor(num_drafts, device=device)
        offsets = torch.cumsum(drafts + 1, 0) - (drafts + 1)  # each request's first row
        positions = torch.arange(max_drafts + 1, device=device)
        valid = positions[:max_drafts].unsqueeze(0) < drafts.unsqueeze(1)  # [requests, k]
        # Padding rows repeat a request's last row: read, never used.
        rows = offsets.unsqueeze(1) + torch.minimum(positions.unsqueeze(0), drafts.unsqueeze(1))
        draft_offsets = offsets - torch.arange(num_requests, device=device)  # first draft of each
        draft_rows = draft_offsets.unsqueeze(1) + torch.minimum(positions[:max_drafts].unsqueeze(0),
                                                                (drafts - 1).clamp_min(0).unsqueeze(1))
        draft_rows = draft_rows.clamp(0, max(len(draft_token_ids) - 1, 0))  # rows of no draft read one
        padded_drafts = torch.zeros(num_requests, max_drafts, dtype=torch.long, device=device)
        if draft_token_ids:
            flat = torch.tensor(draft_token_ids, device=device)
            padded_drafts = torch.where(valid, flat[draft_rows], 0)

        p_draft = probs[rows[:, :max_drafts], padded_drafts]  # p_j(d_j)
        if draft_probs is None:
            q_draft = torch.ones_like(p_draft)
        else:
            q_draft = draft_probs[draft_rows, padded_drafts]
        uniform = self._uniforms(requests, num_drafts, max_drafts, device)
        accept = valid & (uniform * q_draft < p_draft)  # u < p/q without dividing by q
        num_accepted = accept.long().cumprod(dim=1).sum(dim=1)

        final_rows = rows.gather(1, num_accepted.unsqueeze(1)).squeeze(1)
        final = probs[final_rows]
        rejected = num_accepted < drafts
        if bool(rejected.any()):
            at = num_accepted.clamp_max(max(max_drafts - 1, 0)).unsqueeze(1)
            rejected_token = padded_drafts.gather(1, at).squeeze(1)
            if draft_probs is None:
                q = torch.zeros_like(final).scatter_(1, rejected_token.unsqueeze(1), 1.0)
            else:
                q = draft_probs[draft_rows.gather(1, at).squeeze(1)]
            residual = (final - q).clamp_min(0.0)
            mass = residual.sum(dim=1, keepdim=True)
            # p == q leaves no residual mass, but then nothing is rejected: keep p there.
            residual = torch.where(mass > 0, residual / mass.clamp_min(torch.finfo(mass.dtype).tiny), final)
            final = torch.where(rejected.unsqueeze(1), residual, final)
        return Verified(num_accepted, self._draw(final, requests, vocab_size))

    @staticmethod
    def verify_argmax(logits: Tensor, num_drafts: Sequence[int], draft_token_ids: Sequence[int]) -> Verified:
        """`verify` for rows that are all plain greedy with point-mass drafts: p is a point mass
        at each row's argmax, so a draft is accepted while it equals its row's argmax and the
        run ends with the argmax of the row after the last accepted draft. The same outcome
        as `verify` with one kernel and one read, where the general path launches some thirty
        small ones (a batch-1 verifying step of a small model is bound by them)."""
        chosen = logits.argmax(dim=-1).tolist()
        num_accepted, token_ids = [], []
        row = first_draft = 0
        for count in num_drafts:
            drafts = draft_token_ids[first_draft:first_draft + count]
            accepted = 0
            while accepted < count and drafts[accepted] == chosen[row + accepted]:
                accepted += 1
            num_accepted.append(accepted)
            token_ids.append(chosen[row + accepted])
            row += count + 1
            first_draft += count
        return Verified(torch.tensor(num_accepted), torch.tensor(token_ids))

    def _uniforms(self, requests: Sequence[SamplingInput], num_drafts: Sequence[int], width: int,
                  device: torch.device) -> Tensor:
        """U[0, 1) per request and draft position; 0 for greedy requests (their p is a point
        mass, so u does not matter) so that they draw nothing. A seeded request draws one
        per draft of its own, whatever the batch's widest."""
        uniform = torch.zeros(len(requests), width, device=device)
        if width:
            self._fill(uniform, requests, lambda block, generator: block.uniform_(generator=generator), num_drafts)
        return uniform

    def _draw(self, probs: Tensor, requests: Sequence[SamplingInput], vocab_size: int) -> Tensor:
        """One token per row of `probs`: argmax for greedy requests, else argmax(p / E),
        E ~ Exponential(1), which picks token i with probability p[i]."""
        token_ids = probs.argmax(dim=-1)
        if all(request.params.greedy for request in requests):
            return token_ids
        noise = torch.ones(len(requests), vocab_size, device=probs.device)
        self._fill(noise, requests, lambda block, generator: block.exponential_(generator=generator))
        noise.clamp_min_(torch.finfo(noise.dtype).tiny)
        sampled = torch.tensor([not request.params.greedy for request in requests], device=probs.device)
        return torch.where(sampled, (probs / noise).argmax(dim=-1), token_ids)

    def _fill(self, out: Tensor, requests: Sequence[SamplingInput], draw,
              row_widths: Sequence[int] | None = None) -> None:
        """Fill the rows of sampled requests with `draw(block, generator)`: the unseeded ones
        in one block from the shared generator, each seeded one from its own."""
        shared = [row for row, request in enumerate(requests)
                  if not request.params.greedy and request.params.seed is None]
        if shared:
            block = draw(torch.empty(len(shared), out.shape[1], device=out.device), self.sampler.shared_generator)
            out[torch.tensor(shared, device=out.device)] = block
        for row, request in enumerate(requests):
            if not request.params.greedy and request.params.seed is not None:
                width = out.shape[1] if row_widths is None else row_widths[row]
                draw(out[row, :width], self.sampler.generator_for(request))
