"""Seeded workloads: what each request asks, planned before anything is sent.

Every workload is a stream of conversations; all but `multi-turn` have one turn each.

    random         a fresh prompt per request (no shared prefix)
    shared-prefix  one of N system prompts, then a different question each time
    multi-turn     users whose history (their messages and the server's replies) grows turn by turn;
                   with a think time, each user waits (exponentially, that mean) before the next turn
    document-qa    one long document, then a different question each time
    reasoning      a question with a `thinking_budget`

Random draws (offsets, lengths, prefix choices) are made in order from one `random.Random(seed)`
before any prompt text is fitted, so a seed gives the same plan whatever the server's timing.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from .corpus import Segment

WORKLOADS = ("random", "shared-prefix", "multi-turn", "document-qa", "reasoning")
CHAT_WORKLOADS = ("multi-turn", "reasoning")
QUESTION_LEAD = "Question: "
DOCUMENT_LEAD = "Answer questions about this document.\n\n"
REASONING_LEAD = "Think step by step about what this passage describes, then answer briefly. "
BUILD_BATCH = 32


@dataclass(slots=True, frozen=True)
class Lengths:
    """A token length: fixed (`128`) or drawn uniformly from an inclusive range (`64:256`)."""

    low: int
    high: int

    @classmethod
    def parse(cls, text: str) -> Lengths:
        low, _, high = text.partition(":")
        lengths = cls(int(low), int(high or low))
        if not 1 <= lengths.low <= lengths.high:
            raise ValueError(f"a length must be N or LOW:HIGH with 1 <= LOW <= HIGH, got {text!r}")
        return lengths

    def draw(self, rng: random.Random) -> int:
        return self.low if self.low == self.high else rng.randint(self.low, self.high)

    def __str__(self) -> str:
        return str(self.low) if self.low == self.high else f"{self.low}:{self.high}"


@dataclass(slots=True, frozen=True)
class WorkloadSpec:
    name: str
    input_len: Lengths
    output_len: Lengths
    prefix_len: Lengths = Lengths(512, 512)
    num_prefixes: int = 4
    document_len: Lengths = Lengths(2000, 2000)
    num_turns: int = 1
    thinking_budget: int | None = None
    seed: int = 0
    think_time_s: float = 0.0  # multi-turn: a user's mean wait after a reply before the next turn

    @property
    def turns_per_conversation(self) -> int:
        return self.num_turns if self.name == "multi-turn" else 1


# Per-workload defaults for the options left unset on the command line.
DEFAULTS: dict[str, dict[str, str | int]] = {
    "random": {"input_len": "256", "output_len": "128"},
    "shared-prefix": {"input_len": "64", "output_len": "64"},
    "multi-turn": {"input_len": "64", "output_len": "64", "num_turns": 4},
    "document-qa": {"input_len": "32", "output_len": "64"},
    "reasoning": {"input_len": "128", "output_len": "256", "thinking_budget": 128},
}


@dataclass(slots=True, frozen=True)
class SegmentPlan:
    start: int
    num_tokens: int
    lead: str = ""


@dataclass(slots=True)
class Turn:
    user: Segment
    output_len: int
    think_s: float = 0.0  # seconds its user waits after the previous turn's reply before sending it


@dataclass(slots=True)
class Conversation:
    """A system segment sent first (a shared prefix or a document), then one or more user turns."""

    index: int
    system: Segment | None
    turns: list[Turn]
    thinking_budget: int | None = None
    replies: list[str] = field(default_factory=list)  # the server's answers so far, turn by turn


@dataclass(slots=True)
class ConversationPlan:
    index: int
    system: SegmentPlan | None
    turns: list[tuple[SegmentPlan, int]]  # (user segment, output length)
    think_s: list[float] = field(default_factory=list)  # per turn (the first 0.0); empty: none


class Planner:
    """Draws the random choices of each conversation, in order."""

    def __init__(self, spec: WorkloadSpec, num_words: int) -> None:
        self.spec = spec
        self.num_words = num_words
        self.rng = random.Random(spec.seed)
        self.prefixes = [self._segment(spec.prefix_len, "") for _ in range(spec.num_prefixes)]
        self.document = self._segment(spec.document_len, DOCUMENT_LEAD)
        self.next_index = 0

    def _segment(self, lengths: Lengths, lead: str) -> SegmentPlan:
        return SegmentPlan(self.rng.randrange(self.num_words), lengths.draw(self.rng), lead)

    def _turn(self, lead: str) -> tuple[SegmentPlan, int]:
        user = self._segment(self.spec.input_len, lead)
        return user, self.spec.output_len.draw(self.rng)

    def _thinks(self) -> list[float]:
        """Each turn's wait before it is sent; drawn only with a think time, so that a plan without
        one draws as before."""
        mean = self.spec.think_time_s
        if mean <= 0:
            return []
        return [0.0] + [self.rng.expovariate(1 / mean) for _ in range(self.spec.num_turns - 1)]

    def plan(self) -> ConversationPlan:
        name, index = self.spec.name, self.next_index
        self.next_index += 1
        if name == "random":
            return ConversationPlan(index, None, [self._turn("")])
        if name == "shared-prefix":
            system = self.prefixes[self.rng.randrange(len(self.prefixes))]
            return ConversationPlan(index, system, [self._turn(QUESTION_LEAD)])
        if name == "multi-turn":
            return ConversationPlan(index, None, [self._turn("") for _ in range(self.spec.num_turns)], self._thinks())
        if name == "document-qa":
            return ConversationPlan(index, self.document, [self._turn(QUESTION_LEAD)])
        if name == "reasoning":
            return ConversationPlan(index, None, [self._turn(REASONING_LEAD)])
        raise ValueError(f"unknown workload {name!r}; choose one of {', '.join(WORKLOADS)}")


async def build(plan: ConversationPlan, prompts, thinking_budget: int | None) -> Conversation:
    system = await prompts.segment(*_args(plan.system)) if plan.system is not None else None
    users = await asyncio.gather(*(prompts.segment(*_args(user)) for user, _ in plan.turns))
    thinks = plan.think_s or [0.0] * len(plan.turns)
    turns = [Turn(user, output_len, think) for user, (_, output_len), think in zip(users, plan.turns, thinks)]
    return Conversation(plan.index, system, turns, thinking_budget)


def _args(segment: SegmentPlan) -> tuple[int, int, str]:
    return segment.start, segment.num_tokens, segment.lead


async def conversations(spec: WorkloadSpec, prompts, num_conversations: int | None) -> AsyncIterator[Conversation]:
    """Conversations in index order, fitted a batch at a time; endless when no count is given."""
    planner = Planner(spec, len(prompts.words))
    budget = spec.thinking_budget if spec.name == "reasoning" else None
    while num_conversations is None or planner.next_index < num_conversations:
        remaining = BUILD_BATCH if num_conversations is None else min(BUILD_BATCH,
                                                                      num_conversations - planner.next_index)
        plans = [planner.plan() for _ in range(remaining)]
        for conversation in await asyncio.gather(*(build(p, prompts, budget) for p in plans)):
            yield conversation


def num_conversations(spec: WorkloadSpec, num_requests: int | None) -> int | None:
    if num_requests is None:
        return None
    turns = spec.turns_per_conversation
    return -(-num_requests // turns)
