"""Speculative decoding in the one step pipeline: drafts into the plan, verification after
the forward.

    schedule(lookahead=k)   the scheduler reserves KV slots for up to k drafts per decode
    propose(plan)           the proposer fills `ScheduledChunk.draft_token_ids`
    pack_step / execute     each drafted chunk is 1 + d query rows; the runner returns the
                            logits of all of them (`PackedStep.logits_rows`)
    verify                  p per row with the sampler's rules for that position, then exact
                            rejection sampling (rejection.py)
    Scheduler.update        accepted drafts + the recovered/bonus token, committed token by
                            token: stop rules, max_tokens, the thinking budget, block hashing

Row j of a request (after j of its drafts) is sampled as if those j drafts were committed:
its penalties count them, its min_tokens mask counts them, and a thinking budget forces the
token its state would force after them. So a run is cut at the budget and the end marker
forced exactly where plain decoding forces it. Only accepted tokens ever count as computed,
so the KV written for rejected drafts is never hashed or shared; later steps overwrite it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from spillway.protocol.messages import TokenLogprobs
from spillway.protocol.reasoning import advance, forced_token
from spillway.worker.core.request import Request
from spillway.worker.sample.sampler import Sampler, SamplingInput, is_plain_greedy
from spillway.worker.sample.token_masks import TokenMasks
from spillway.worker.speculative.proposer import Proposer
from spillway.worker.speculative.rejection import RejectionSampler, target_probs
from spillway.worker.speculative.switch import SpeculationSwitch
from spillway.worker.core.step_plan import StepPlan


@dataclass(slots=True)
class SpecMetrics:
    """Cumulative counts, as vLLM names them (`vllm:spec_decode_*`)."""

    num_drafts: int = 0  # verified requests that had at least one draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)


@dataclass(slots=True)
class VerifiedStep:
    token_ids: Tensor  # int64 [requests]: each request's recovered or bonus token
    accepted: dict[str, list[int]]  # request id -> its accepted drafts
    logprobs: dict[str, list[TokenLogprobs]]  # for the requests that asked, one per run token


def sampling_input(request: Request, drafts: tuple[int, ...] = ()) -> SamplingInput:
    """The sampler's view of `request` as if `drafts` were committed after its tokens."""
    state = request.thinking_state
    if state is not None:
        for token in drafts:
            state = advance(request.thinking_policy, state, token)[0]
    outputs = _DraftedOutputs(request.outputs, drafts) if drafts else request.outputs
    return SamplingInput(request.request_id, request.params, request.sampling_prompt, outputs,
                         None if state is None else forced_token(state))


class _DraftedOutputs(Sequence[int]):
    """A request's output token ids followed by drafts, without copying the outputs (most
    rows only read their number; penalties iterate over them)."""

    __slots__ = ("_outputs", "_drafts")

    def __init__(self, outputs: list[int], drafts: tuple[int, ...]) -> None:
        self._outputs, self._drafts = outputs, drafts

    def __len__(self) -> int:
        return len(self._outputs) + len(self._drafts)

    def __getitem__(self, index):
        return list(self)[index]

    def __iter__(self) -> Iterator[int]:
        return itertools.chain(self._outputs, self._drafts)


class SpecDecoder:
    """The driver's speculative decoding: a proposer, the switch, the rejection sampler."""

    def __init__(self, proposer: Proposer, switch: SpeculationSwitch, sampler: Sampler) -> None:
        self.proposer = proposer
        self.switch = switch
        self.sampler = sampler
        self.rejection = RejectionSampler(sampler)
        self.metrics = SpecMetrics(accepted_per_position=[0] * switch.num_speculative_tokens)
        self._draft_probs: dict[str, Tensor] = {}

    def lookahead(self, batch_size: int) -> int:
        return self.switch.lookahead(batch_size)

    def propose(self, plan: StepPlan) -> bool:
        """Fill the drafts of the chunks with draft slots; whether any got one. A plan with
        drafts is committed before the next is planned: it never runs ahead."""
        chunks = [chunk for chunk in plan.chunks if chunk.num_draft_slots]
        if not chunks:
            return False
        proposals = self.proposer.propose([chunk.request for chunk in chunks],
                                          [chunk.num_draft_slots for chunk in chunks])
        self._draft_probs.clear()
        for chunk, proposal in zip(chunks, proposals):
            chunk.draft_token_ids = proposal.token_ids[:chunk.num_draft_slots]
            if proposal.probs is not None and chunk.draft_token_ids:
                self._draft_probs[chunk.request.request_id] = proposal.probs[:len(chunk.draft_token_ids)]
        drafted = any(chunk.draft_token_ids for chunk in chunks)
        if drafted:
            plan.run_ahead = False
        else:  # slots offered, nothing proposed: for the switch, drafts that all failed
            self.switch.observe(sum(chunk.num_draft_slots for chunk in chunks), 0)
        return drafted

    def verify(self, logits: Tensor, plan: StepPlan, sample_rows: list[int],
               grammar_masks: Callable[[list[tuple[Request, tuple[int, ...]]]], TokenMasks | None] | None = None
               ) -> VerifiedStep:
        """`logits`: the rows of `PackedStep.logits_rows`, the sampled chunks in order.
        `grammar_masks`: the constrained positions' masks, given each request's drafts
        (worker/driver/constrained.py): a draft its grammar refuses gets no probability, so
        it is rejected, never emitted."""
        chunks = [plan.chunks[row] for row in sample_rows]
        rows: list[SamplingInput] = []  # one per verified position
        first_rows: list[int] = []  # each request's first row
        flat_drafts: list[int] = []
        for chunk in chunks:
            drafts = chunk.draft_token_ids
            first_rows.append(len(rows))
            rows += [sampling_input(chunk.request, drafts[:j]) for j in range(len(drafts) + 1)]
            flat_drafts += drafts
        assert logits.shape[0] == len(rows), (logits.shape, len(rows))
        raw_logits = logits
        if grammar_masks is not None:
            masks = grammar_masks([(chunk.request, tuple(chunk.draft_token_ids)) for chunk in chunks])
            if masks is not None:
                logits = masks.apply(logits)
        num_drafts = [len(chunk.draft_token_ids) for chunk in chunks]
        firsts = [rows[row] for row in first_rows]
        if not self._draft_probs and all(is_plain_greedy(row) and row.forced_token_id is None for row in rows):
            verified = self.rejection.verify_argmax(logits, num_drafts, flat_drafts)
        else:
            probs = target_probs(logits, rows, self.sampler.eos_token_ids)
            verified = self.rejection.verify(probs, firsts, num_drafts, flat_drafts,
                                             self._gather_draft_probs(chunks, probs.shape[-1], probs.device))
        num_accepted = verified.num_accepted.tolist()
        accepted = {chunk.request.request_id: list(chunk.draft_token_ids[:count])
                    for chunk, count in zip(chunks, num_accepted)}
        self._count(num_drafts, num_accepted, sum(chunk.num_draft_slots for chunk in chunks))
        logprobs = self._logprobs(raw_logits, rows, first_rows, chunks, num_accepted, verified.token_ids)
        return VerifiedStep(verified.token_ids, accepted, logprobs)

    def _gather_draft_probs(self, chunks, vocab_size: int, device: torch.device) -> Tensor | None:
        if not self._draft_probs:
            return None
        parts = []
        for chunk in chunks:
            drafts = chunk.draft_token_ids
            probs = self._draft_probs.get(chunk.request.request_id)
            if probs is None:  # a point mass per draft
                probs = torch.zeros(len(drafts), vocab_size, device=device)
                probs[torch.arange(len(drafts), device=device), torch.tensor(drafts, device=device)] = 1.0
            parts.append(probs.to(device=device, dtype=torch.float32))
        return torch.cat(parts)

    def _count(self, num_drafts: list[int], num_accepted: list[int], num_slots: int) -> None:
        metrics = self.metrics
        for drafted, count in zip(num_drafts, num_accepted):
            if drafted:
                metrics.num_drafts += 1
                metrics.num_draft_tokens += drafted
                metrics.num_accepted_tokens += count
                for position in range(count):
                    metrics.accepted_per_position[position] += 1
        self.switch.observe(num_slots, sum(num_accepted))

    def _logprobs(self, logits: Tensor, rows: list[SamplingInput], first_rows: list[int], chunks,
                  num_accepted: list[int], final_tokens: Tensor) -> dict[str, list[TokenLogprobs]]:
        """Logprobs of each committed token (accepted drafts, then the last), from the raw
        logits of its row, for the requests that asked."""
        wanted = [i for i, chunk in enumerate(chunks) if chunk.request.params.logprobs is not None]
        if not wanted:
            return {}
        finals = final_tokens.tolist()
        row_index: list[int] = []
        token_ids: list[int] = []
        owners: list[str] = []
        for i in wanted:
            chunk, count = chunks[i], num_accepted[i]
            row_index += range(first_rows[i], first_rows[i] + count + 1)
            token_ids += [*chunk.draft_token_ids[:count], finals[i]]
            owners += [chunk.request.request_id] * (count + 1)
        device = logits.device
        by_row = self.sampler.logprobs(logits[torch.tensor(row_index, device=device)],
                                       [rows[r] for r in row_index], torch.tensor(token_ids, device=device))
        result: dict[str, list[TokenLogprobs]] = {}
        for j, owner in enumerate(owners):
            result.setdefault(owner, []).append(by_row[j])
        return result

    def forget(self, request_id: str) -> None:
        self.proposer.forget(request_id)

