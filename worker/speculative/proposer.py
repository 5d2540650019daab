"""Proposers: where draft tokens come from. Each proposes up to a number of tokens per
request after its committed tokens; what it proposes is verified exactly (rejection.py), so a
proposer changes speed, never outputs.

    NgramProposer   prompt lookup: the tokens that followed the latest earlier occurrence of
                    the context's last n tokens (no model)
    ReplayProposer  a recorded target output, replayed (acceptance 1): benchmarks only
    draft model     worker/speculative/draft_model.py
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
from torch import Tensor

from spillway.worker.core.request import Request


@dataclass(slots=True)
class Proposal:
    """Draft tokens for one request. `probs`: float32 [len(token_ids), vocab], the draft
    distribution q each was drawn from; None: each is a point mass (a deterministic proposer)."""

    token_ids: tuple[int, ...] = ()
    probs: Tensor | None = None


NO_PROPOSAL = Proposal()


class Proposer(Protocol):
    def propose(self, requests: Sequence[Request], max_drafts: Sequence[int]) -> list[Proposal]:
        """Up to `max_drafts[i]` (>= 1) tokens following `requests[i].all_token_ids`."""
        ...

    def forget(self, request_id: str) -> None:
        """The request finished: drop what is kept for it."""
        ...


class NgramProposer:
    """Prompt lookup: for n from `max_n` down to `min_n`, find the latest earlier occurrence of
    the context's last n tokens and propose the tokens that followed it."""

    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"prompt lookup needs 1 <= prompt_lookup_min <= prompt_lookup_max, got {min_n}, {max_n}")
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, requests: Sequence[Request], max_drafts: Sequence[int]) -> list[Proposal]:
        return [Proposal(ngram_lookup(request.all_token_ids, self.min_n, self.max_n, count))
                for request, count in zip(requests, max_drafts)]

    def forget(self, request_id: str) -> None:
        pass


def ngram_lookup(token_ids: Sequence[int], min_n: int, max_n: int, count: int) -> tuple[int, ...]:
    """Up to `count` tokens that followed the latest earlier match of the longest suffix
    n-gram (max_n >= n >= min_n) of `token_ids`; () when none matches."""
    num_tokens = len(token_ids)
    if num_tokens <= min_n:
        return ()
    tokens = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(max_n, num_tokens - 1), min_n - 1, -1):
        # Windows starting at 0 .. num_tokens - n - 1: every occurrence but the suffix itself.
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
        matches = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
        if matches.size:
            follow = int(matches[-1]) + n
            return tuple(tokens[follow:follow + count].tolist())
    return ()


class ReplayProposer:
    """Proposes a recorded output of the target for the same prompt (its prompt token ids as
    the key): every draft is accepted, which measures the verification's best case."""

    def __init__(self, outputs: Mapping[tuple[int, ...], Sequence[int]]) -> None:
        self.outputs = {tuple(prompt): list(output) for prompt, output in outputs.items()}

    def propose(self, requests: Sequence[Request], max_drafts: Sequence[int]) -> list[Proposal]:
        proposals = []
        for request, count in zip(requests, max_drafts):
            output = self.outputs.get(tuple(request.prompt_token_ids))
            if output is None:
                proposals.append(NO_PROPOSAL)
                continue
            done = request.num_output_tokens
            if output[:done] != request.output_token_ids:
                proposals.append(NO_PROPOSAL)  # the run went elsewhere (sampling): nothing to replay
                continue
            proposals.append(Proposal(tuple(output[done:done + count])))
        return proposals

    def forget(self, request_id: str) -> None:
        pass
