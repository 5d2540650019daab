"""Reasoning parsers: which markers delimit thinking, and the thinking-budget policy of a request.

The markers' token ids always come from the serving tokenizer. The split itself runs the
state machine of protocol/reasoning.py over token ids, the same one the worker uses to
enforce the budget, so both sides agree on where thinking ends.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field

from spillway.protocol.reasoning import Phase, Role, ThinkingPolicy, ThinkingState, advance, initial_state

# Parser name -> (start marker, end marker). Both families write <think> ... </think>.
PARSERS = {"deepseek_r1": ("<think>", "</think>"), "qwen3": ("<think>", "</think>")}


@dataclass(frozen=True, slots=True)
class ReasoningMarkers:
    start_text: str
    end_text: str
    start_token_ids: tuple[int, ...]
    end_token_ids: tuple[int, ...]
    transition_text: str = ""
    transition_token_ids: tuple[int, ...] = ()


def resolve_markers(tokenizer, parser: str | None = None, config: str | dict | None = None) -> ReasoningMarkers:
    """Markers for `parser` (deepseek_r1 when None), or from a `--reasoning-config` JSON
    object {"start": "<think>", "end": "</think>", "transition": "optional phrase"}."""
    if config is not None:
        spec = json.loads(config) if isinstance(config, str) else dict(config)
        unknown = set(spec) - {"start", "end", "transition"}
        if unknown or not isinstance(spec.get("start"), str) or not isinstance(spec.get("end"), str):
            raise ValueError('reasoning config must be {"start": str, "end": str, "transition": str (optional)}')
        start, end, transition = spec["start"], spec["end"], spec.get("transition", "")
    else:
        name = parser or "deepseek_r1"
        if name not in PARSERS:
            raise ValueError(f"unknown reasoning parser {name!r}; choose one of {', '.join(PARSERS)}")
        (start, end), transition = PARSERS[name], ""
    if not start or not end:
        raise ValueError("reasoning markers must not be empty")

    def ids(text: str) -> tuple[int, ...]:
        return tuple(tokenizer.encode(text, add_special_tokens=False)) if text else ()

    return ReasoningMarkers(start, end, ids(start), ids(end), transition, ids(transition))


def prompt_opens_thinking(prompt_token_ids: Sequence[int], markers: ReasoningMarkers) -> bool:
    """Whether the prompt ends inside thinking: its last start marker after its last end marker."""
    return _last_index(prompt_token_ids, markers.start_token_ids) > _last_index(prompt_token_ids,
                                                                              markers.end_token_ids)


def thinking_policy(markers: ReasoningMarkers, prompt_token_ids: Sequence[int], budget: int | None) -> ThinkingPolicy:
    return ThinkingPolicy(
        start_token_ids=markers.start_token_ids,
        end_token_ids=markers.end_token_ids,
        budget=budget,
        transition_token_ids=markers.transition_token_ids,
        prompt_opened=prompt_opens_thinking(prompt_token_ids, markers),
    )


@dataclass(slots=True)
class ReasoningSplitter:
    """Splits a request's output token ids into reasoning and content as they arrive.

    Tokens that might begin a marker are held until the next token decides; markers belong
    to neither part.
    """

    policy: ThinkingPolicy
    state: ThinkingState = field(init=False)
    held: list[int] = field(default_factory=list)
    num_reasoning_tokens: int = 0

    def __post_init__(self) -> None:
        self.state = initial_state(self.policy)

    def feed(self, token_ids: Sequence[int]) -> tuple[list[int], list[int]]:
        """(reasoning ids, content ids) released by these tokens, in order within each part."""
        reasoning: list[int] = []
        content: list[int] = []
        for token_id in token_ids:
            self.held.append(token_id)
            self.state, roles = advance(self.policy, self.state, token_id)
            for role in roles:
                resolved = self.held.pop(0)
                if role == Role.REASONING:
                    reasoning.append(resolved)
                elif role == Role.CONTENT:
                    content.append(resolved)
        self.num_reasoning_tokens += len(reasoning)
        return reasoning, content

    def flush(self) -> tuple[list[int], list[int]]:
        """At the end of the output: held tokens are what they would have been without a marker."""
        held, self.held = self.held, []
        if self.state.phase in (Phase.THINKING, Phase.FORCING):  # an unfinished end marker
            self.num_reasoning_tokens += len(held)
            return held, []
        return [], held


def _last_index(sequence: Sequence[int], pattern: Sequence[int]) -> int:
    n = len(pattern)
    for start in range(len(sequence) - n, -1, -1):
        if list(sequence[start:start + n]) == list(pattern):
            return start
    return -1
