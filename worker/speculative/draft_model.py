"""A draft model proposer: a small model with the target's tokenizer proposes k tokens by
decoding k steps of its own, over a private paged KV pool.

Each request keeps the tokens whose KV the draft holds (`_DraftSequence.tokens`): the
committed tokens it has seen and the drafts it fed itself. When proposing, the longest
prefix of those that the request really committed is kept, the rest (rejected drafts) is
overwritten: the draft catches up over the new committed tokens in one chunk (a whole prompt
the first time), then decodes k - 1 single tokens. Greedy requests take the draft's argmax
(a point mass q); sampled ones draw from the draft's distribution under the request's
temperature, top-k, top-p and min-p, which is the q that verification divides by. A seeded
request draws from a generator of its own, so its outputs stay a function of its seed.

On CUDA (without enforce_eager) its runner captures decode graphs for batches up to the
switch's largest (`max_graph_batch_size`), so the k - 1 single-token steps replay graphs, and
prefill graphs: the catch-up forward (one new token per request, as the draft holds the KV of
the drafts it fed itself; two after a fully accepted run; a new prompt) replays one of either. Its pool and its
graphs are allocated before the target's pool is sized, so on CUDA the target's pool takes
only the memory the draft leaves. The engine sizes its pool with the target's
(`executor_start.draft_pool_blocks`): the same number of tokens out of one budget.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from spillway.worker.runner.executor import load_model
from spillway.worker.runner.kv_blocks import kv_block_bytes
from spillway.worker.runner.kv_budget import blocks_per_request
from spillway.worker.runner.model_runner import ChunkInput, ModelRunner
from spillway.worker.models import loader
from spillway.worker.core.request import Request
from spillway.worker.sample.sampler import filtered_logits
from spillway.worker.speculative.proposer import NO_PROPOSAL, Proposal


@dataclass(slots=True)
class _DraftSequence:
    blocks: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # the tokens whose KV the draft holds, in order
    num_committed: int = 0  # a prefix of `tokens` known to be the request's committed tokens
    generator: torch.Generator | None = None  # a seeded request's own


class DraftModelProposer:
    """Proposes with a draft model over its own KV blocks (see the module doc)."""

    def __init__(self, runner: ModelRunner, num_blocks: int, max_num_tokens: int) -> None:
        self.runner = runner
        self.block_size = runner.block_size
        self.max_num_tokens = max_num_tokens  # tokens per forward (the runner's staging limit)
        self._free_blocks = list(range(num_blocks - 1, -1, -1))
        self._sequences: dict[str, _DraftSequence] = {}
        self._shared_generator = torch.Generator(device=runner.device)
        self._shared_generator.manual_seed(0x5EED)

    @classmethod
    def load(cls, model: str, *, target_vocab_size: int, device: torch.device, dtype: torch.dtype,
             max_model_len: int, max_num_seqs: int, block_size: int, max_num_batched_tokens: int,
             num_speculative_tokens: int, max_graph_batch_size: int | None = None,
             pool_blocks: Callable[[int], int] | None = None) -> DraftModelProposer:
        """The draft model from `model` (a folder or GGUF file); ValueError when its vocabulary
        differs from the target's (its tokens would not be the target's tokens). `pool_blocks`:
        its pool's block count from the bytes of one of its blocks, once its weights are loaded
        (ValueError when too few); without it, what `max_num_seqs` requests use. With
        `max_graph_batch_size` (CUDA), its runner's CUDA graphs are captured, decode batches up
        to that size."""
        files = loader.resolve_model(model, "auto")
        hf_config = loader.load_config(files)
        if int(hf_config.vocab_size) != target_vocab_size:
            raise ValueError(f"the speculative model's vocabulary has {int(hf_config.vocab_size)} tokens and the "
                             f"target's {target_vocab_size}: a draft model needs the target's tokenizer")
        draft = load_model(hf_config, files, device=device, dtype=dtype, seed=0)
        if pool_blocks is not None:
            num_blocks = pool_blocks(kv_block_bytes(hf_config, block_size, dtype))
        else:
            num_blocks = max_num_seqs * blocks_per_request(max_model_len, block_size, num_speculative_tokens)
        runner = ModelRunner(draft, num_blocks=num_blocks, block_size=block_size, device=device, dtype=dtype,
                             max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                             max_model_len=max_model_len + num_speculative_tokens)
        if max_graph_batch_size is not None:
            runner.capture_graphs(max_graph_batch_size)
        return cls(runner, num_blocks, max_num_batched_tokens)

    def forget(self, request_id: str) -> None:
        sequence = self._sequences.pop(request_id, None)
        if sequence is not None:
            self._free_blocks += reversed(sequence.blocks)

    def propose(self, requests: Sequence[Request], max_drafts: Sequence[int]) -> list[Proposal]:
        proposals = [NO_PROPOSAL] * len(requests)
        active = [i for i, (request, count) in enumerate(zip(requests, max_drafts))
                  if count > 0 and self._make_room(request, count)]
        if not active:
            return proposals
        logits = self._catch_up(requests, active)
        drafts: dict[int, list[int]] = {i: [] for i in active}
        probs: dict[int, list[torch.Tensor]] = {i: [] for i in active}
        for step in range(max(max_drafts[i] for i in active)):
            if step:
                rows = [i for i in active if max_drafts[i] > step]
                chunks = []
                for i in rows:
                    sequence, token = self._sequences[requests[i].request_id], drafts[i][-1]
                    chunks.append(ChunkInput([token], len(sequence.tokens), self._slot_table(sequence)))
                    sequence.tokens.append(token)
                logits = dict(zip(rows, self.runner.execute(chunks)))
            for i, row_logits in logits.items():
                token, q = self._choose(requests[i], row_logits)
                drafts[i].append(token)
                if q is not None:
                    probs[i].append(q)
            active = [i for i in active if max_drafts[i] > step + 1]
        for i, tokens in drafts.items():
            proposals[i] = Proposal(tuple(tokens), torch.stack(probs[i]) if probs[i] else None)
        return proposals

    def _make_room(self, request: Request, count: int) -> bool:
        """Keep the request's valid KV, free nothing else; blocks for its committed tokens and
        `count - 1` fed drafts. False (no proposal) when the pool is out of blocks."""
        sequence = self._sequences.get(request.request_id)
        if sequence is None:
            sequence = self._sequences[request.request_id] = _DraftSequence()
            if request.params.seed is not None and not request.params.greedy:
                sequence.generator = torch.Generator(device=self.runner.device)
                sequence.generator.manual_seed(request.params.seed)
        committed = request.all_token_ids
        valid = sequence.num_committed
        for held, token in zip(sequence.tokens[valid:], committed[valid:]):
            if held != token:
                break
            valid += 1
        # The last committed token is always fed again: its logits give the first draft.
        del sequence.tokens[min(valid, len(committed) - 1):]
        sequence.num_committed = min(sequence.num_committed, len(sequence.tokens))
        needed = -(-(len(committed) + count - 1) // self.block_size)
        if needed - len(sequence.blocks) > len(self._free_blocks):
            return False
        while len(sequence.blocks) < needed:
            sequence.blocks.append(self._free_blocks.pop())
        return True

    def _slot_table(self, sequence: _DraftSequence) -> list[int]:
        return sequence.blocks

    def _catch_up(self, requests: Sequence[Request], indices: list[int]) -> dict[int, torch.Tensor]:
        """Feed each request's committed tokens the draft has not seen, in forwards of at most
        `max_num_tokens` tokens; the logits of each request's last token, by its index."""
        pending = {}
        for i in indices:
            request = requests[i]
            sequence = self._sequences[request.request_id]
            pending[i] = request.all_token_ids[len(sequence.tokens):]
            sequence.num_committed = request.num_tokens
        last: dict[int, torch.Tensor] = {}
        while pending:
            chunks, owners, budget = [], [], self.max_num_tokens
            for i, tokens in list(pending.items()):
                if budget == 0:
                    break
                piece = tokens[:budget]
                sequence = self._sequences[requests[i].request_id]
                chunks.append(ChunkInput(piece, len(sequence.tokens), self._slot_table(sequence)))
                sequence.tokens += piece
                budget -= len(piece)
                owners.append(i)
                if len(piece) == len(tokens):
                    del pending[i]
                else:
                    pending[i] = tokens[len(piece):]
            logits = self.runner.execute(chunks)
            done = [(row, i) for row, i in enumerate(owners) if i not in pending]
            if done:
                # Gathered into a tensor of their own: the next forward may replay a graph that
                # overwrites the runner's logits buffer.
                rows = logits[[row for row, _ in done]]
                last.update((i, rows[j]) for j, (_, i) in enumerate(done))
        return last

    def _choose(self, request: Request, logits: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        """The draft token and the q it was drawn from (None: a point mass, greedy)."""
        if request.params.greedy:
            return int(logits.argmax()), None
        q = filtered_logits(logits.unsqueeze(0).float(), [request.params]).softmax(dim=-1)[0]
        sequence = self._sequences[request.request_id]
        generator = sequence.generator or self._shared_generator
        noise = torch.empty_like(q).exponential_(generator=generator).clamp_min_(torch.finfo(q.dtype).tiny)
        return int((q / noise).argmax()), q
