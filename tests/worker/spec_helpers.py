"""Driving an engine with and without speculation over the same requests."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from spillway.protocol.hashing import block_hashes
from spillway.protocol.messages import FinishReason, Generate, SamplingParams, TokenLogprobs
from spillway.protocol.reasoning import ThinkingPolicy
from spillway.worker.driver.engine import Engine
from spillway.worker.core.request import Request
from spillway.worker.speculative.proposer import Proposal, Proposer


@dataclass(slots=True)
class Job:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    thinking: ThinkingPolicy | None = None
    arrival_step: int = 0


@dataclass(slots=True)
class Outcome:
    tokens: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    num_cached_tokens: int = -1


class RandomProposer:
    """Uniformly random drafts: almost all rejected."""

    def __init__(self, vocab_size: int, seed: int = 0) -> None:
        self.rng = random.Random(seed)
        self.vocab_size = vocab_size

    def propose(self, requests: Sequence[Request], max_drafts: Sequence[int]) -> list[Proposal]:
        return [Proposal(tuple(self.rng.randrange(self.vocab_size) for _ in range(count))) for count in max_drafts]

    def forget(self, request_id: str) -> None:
        pass


def run(engine: Engine, jobs: list[Job], proposer: Proposer | None) -> dict[str, Outcome]:
    """Step `engine` over `jobs` until idle, speculating with `proposer` on every step (the
    switch's costs zeroed), or plainly when None."""
    spec = engine.spec
    if proposer is None:
        engine.spec = None
    else:
        spec.proposer = proposer
        spec.switch.draft_cost = spec.switch.verify_cost = 0.0
    try:
        return _drive(engine, jobs)
    finally:
        engine.spec = spec


def _drive(engine: Engine, jobs: list[Job]) -> dict[str, Outcome]:
    outcomes: dict[str, Outcome] = {}
    step = 0
    while engine.has_work or any(job.arrival_step >= step for job in jobs):
        for job in jobs:
            if job.arrival_step == step:
                msg = Generate(request_id=job.request_id, prompt_token_ids=job.prompt,
                               block_hashes=block_hashes(job.prompt, engine.block_size, engine.root_hash),
                               params=job.params, thinking=job.thinking)
                assert engine.add_request(msg) is None
                outcomes[job.request_id] = Outcome()
        for delta in engine.step():
            outcome = outcomes[delta.request_id]
            assert outcome.finish_reason is None, f"{delta.request_id} got tokens after it finished"
            outcome.tokens += delta.new_token_ids
            if delta.logprobs is not None:
                assert len(delta.logprobs) == len(delta.new_token_ids)
                outcome.logprobs += delta.logprobs
            if delta.num_cached_tokens >= 0:
                outcome.num_cached_tokens = delta.num_cached_tokens
            outcome.finish_reason = delta.finish_reason
        step += 1
        assert step < 5000
    manager = engine.block_manager
    assert manager.num_free_blocks == manager.num_gpu_blocks - sum(1 for b in manager.blocks if b.ref_count > 0)
    return outcomes


def tokens_and_reasons(outcomes: dict[str, Outcome]) -> dict[str, tuple[list[int], FinishReason | None]]:
    return {request_id: (o.tokens, o.finish_reason) for request_id, o in outcomes.items()}
