"""The thinking-budget state machine, one pure function shared by the gateway and the worker.

A reasoning model writes  <think> reasoning </think> answer.  Markers are token-id sequences
(one special token for Qwen3 / DeepSeek-R1; several ordinary tokens for other tokenizers).

    BEFORE --start marker--> THINKING --end marker--> ANSWER
                                |  budget reached
                                v
                             FORCING (transition + rest of the end marker) --> ANSWER

The worker feeds every committed token to `advance` and, while `forced_token` returns an id,
forces it in the sampler: no round trip. The gateway feeds the same tokens to split the stream
into reasoning and content and to count reasoning tokens. Tokens that might begin a marker are
held (`matched`) until the next token decides; `advance` returns the roles of the tokens it
resolved, oldest first.
"""

from __future__ import annotations

from enum import IntEnum

import msgspec


class ThinkingPolicy(msgspec.Struct, frozen=True, kw_only=True):
    """Resolved by the gateway from the tokenizer and the request; sent with `Generate`."""

    start_token_ids: tuple[int, ...]
    end_token_ids: tuple[int, ...]
    budget: int | None = None  # reasoning tokens allowed; None: no cap (still split and counted)
    transition_token_ids: tuple[int, ...] = ()  # forced before the end marker at the budget
    prompt_opened: bool = False  # the prompt already ends inside <think>


class Phase(IntEnum):
    BEFORE = 0
    THINKING = 1
    FORCING = 2
    ANSWER = 3


class Role(IntEnum):
    CONTENT = 0
    REASONING = 1
    MARKER = 2


class ThinkingState(msgspec.Struct, frozen=True, array_like=True):
    phase: Phase
    num_reasoning_tokens: int = 0
    matched: int = 0  # held tokens matching the start (BEFORE) or end (THINKING) marker so far
    forced: tuple[int, ...] = ()  # FORCING: tokens still to force
    forced_markers: int = 0  # how many of `forced` (its tail) belong to the end marker


def initial_state(policy: ThinkingPolicy) -> ThinkingState:
    if not policy.prompt_opened:
        return ThinkingState(Phase.BEFORE)
    return _check_budget(policy, ThinkingState(Phase.THINKING), ())[0]


def forced_token(state: ThinkingState) -> int | None:
    """The token the sampler must produce next, or None to sample freely."""
    return state.forced[0] if state.phase == Phase.FORCING else None


def advance(policy: ThinkingPolicy, state: ThinkingState, token_id: int) -> tuple[ThinkingState, tuple[Role, ...]]:
    """The state after `token_id` is committed, and the roles of the tokens this resolves."""
    match state.phase:
        case Phase.BEFORE:
            return _before(policy, state, token_id)
        case Phase.THINKING:
            return _thinking(policy, state, token_id)
        case Phase.FORCING:
            return _forcing(state, token_id)
        case _:
            return state, (Role.CONTENT,)


def _before(policy, state, token_id):
    start = policy.start_token_ids
    if token_id == start[state.matched]:
        if state.matched + 1 == len(start):
            return _check_budget(policy, ThinkingState(Phase.THINKING), (Role.MARKER,) * len(start))
        return ThinkingState(Phase.BEFORE, matched=state.matched + 1), ()
    released = (Role.CONTENT,) * state.matched
    if token_id == start[0]:
        return ThinkingState(Phase.BEFORE, matched=1), released
    return ThinkingState(Phase.BEFORE), released + (Role.CONTENT,)


def _thinking(policy, state, token_id):
    end = policy.end_token_ids
    count, matched = state.num_reasoning_tokens, state.matched
    if token_id == end[matched]:
        if matched + 1 == len(end):
            return ThinkingState(Phase.ANSWER, count), (Role.MARKER,) * len(end)
        return _check_budget(policy, ThinkingState(Phase.THINKING, count, matched + 1), ())
    # The held tokens were not the end marker after all: they are reasoning.
    released = (Role.REASONING,) * matched
    count += matched
    if token_id == end[0]:
        next_state = ThinkingState(Phase.THINKING, count, 1)
    else:
        next_state = ThinkingState(Phase.THINKING, count + 1)
        released += (Role.REASONING,)
    return _check_budget(policy, next_state, released)


def _forcing(state, token_id):
    if not state.forced or token_id != state.forced[0]:
        # Not what was forced (a caller replaying foreign tokens): treat as the answer.
        return ThinkingState(Phase.ANSWER, state.num_reasoning_tokens), (Role.CONTENT,)
    role = Role.MARKER if len(state.forced) <= state.forced_markers else Role.REASONING
    count = state.num_reasoning_tokens + (role == Role.REASONING)
    rest = state.forced[1:]
    if not rest:
        return ThinkingState(Phase.ANSWER, count), (role,)
    markers = min(state.forced_markers, len(rest))
    return ThinkingState(Phase.FORCING, count, 0, rest, markers), (role,)


def _check_budget(policy: ThinkingPolicy, state: ThinkingState, released: tuple[Role, ...]):
    """Switch to forcing once reasoning (counting held tokens) has used the budget.

    Held tokens are then the start of the end marker, which forcing completes as it stands.
    """
    if policy.budget is None or state.num_reasoning_tokens + state.matched < policy.budget:
        return state, released
    end_rest = policy.end_token_ids[state.matched:]
    transition = policy.transition_token_ids if state.matched == 0 else ()
    forcing = ThinkingState(Phase.FORCING, state.num_reasoning_tokens, 0, transition + end_rest, len(end_rest))
    return forcing, released + (Role.MARKER,) * state.matched
