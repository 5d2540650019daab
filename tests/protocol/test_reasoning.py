"""Table-driven tests of the thinking-budget state machine."""

import pytest

from spillway.protocol.reasoning import (
    Phase, Role, ThinkingPolicy, advance, forced_token, initial_state,
)

C, R, M = Role.CONTENT, Role.REASONING, Role.MARKER
SINGLE = dict(start_token_ids=(10,), end_token_ids=(11,))
# Multi-token markers sharing their first token, like "<" "think" ">" and "<" "/think" ">".
MULTI = dict(start_token_ids=(20, 21, 22), end_token_ids=(20, 23, 22))


def play(policy: ThinkingPolicy, model: list[int], steps: int):
    """The worker's loop: `model[i]` is what the model samples at step i; a forced token wins."""
    state, out, roles = initial_state(policy), [], []
    for step in range(steps):
        token = forced_token(state)
        if token is None:
            token = model[step]
        state, released = advance(policy, state, token)
        out.append(token)
        roles.extend(released)
    return out, roles, state


@pytest.mark.parametrize(
    "policy, model, expected_out, expected_roles, phase, reasoning",
    [
        # No budget: split only.
        (ThinkingPolicy(**SINGLE), [5, 10, 1, 2, 3, 11, 4], [5, 10, 1, 2, 3, 11, 4], [C, M, R, R, R, M, C],
         Phase.ANSWER, 3),
        # The prompt opened thinking: reasoning from the first token; budget 2 forces the end.
        (ThinkingPolicy(**SINGLE, budget=2, prompt_opened=True), [1, 2, 3, 11, 4], [1, 2, 11, 11, 4],
         [R, R, M, C, C], Phase.ANSWER, 2),
        # Budget 0 with thinking opened by the prompt: the end marker comes first.
        (ThinkingPolicy(**SINGLE, budget=0, prompt_opened=True), [1, 2, 3], [11, 2, 3], [M, C, C], Phase.ANSWER, 0),
        # Budget 0, the model opens thinking itself: closed right after the start marker.
        (ThinkingPolicy(**SINGLE, budget=0), [10, 1, 2], [10, 11, 2], [M, M, C], Phase.ANSWER, 0),
        # A budget larger than the thinking changes nothing.
        (ThinkingPolicy(**SINGLE, budget=50, prompt_opened=True), [1, 2, 11, 4], [1, 2, 11, 4], [R, R, M, C],
         Phase.ANSWER, 2),
        # Multi-token end marker: a false start (20 then 5) is reasoning after all.
        (ThinkingPolicy(**MULTI, prompt_opened=True), [1, 20, 5, 20, 23, 22, 7], [1, 20, 5, 20, 23, 22, 7],
         [R, R, R, M, M, M, C], Phase.ANSWER, 3),
        # Multi-token start marker split across tokens, preceded by content.
        (ThinkingPolicy(**MULTI), [4, 20, 21, 22, 1, 20, 23, 22, 9], [4, 20, 21, 22, 1, 20, 23, 22, 9],
         [C, M, M, M, R, M, M, M, C], Phase.ANSWER, 1),
        # The budget is reached while the model is writing the end marker: it is completed as is.
        (ThinkingPolicy(**MULTI, budget=3, prompt_opened=True), [1, 2, 20, 23, 22, 9], [1, 2, 20, 23, 22, 9],
         [R, R, M, M, M, C], Phase.ANSWER, 2),
        # The budget cuts a long thought with a multi-token end marker.
        (ThinkingPolicy(**MULTI, budget=2, prompt_opened=True), [1, 2, 3, 4, 5, 6], [1, 2, 20, 23, 22, 6],
         [R, R, M, M, M, C], Phase.ANSWER, 2),
        # A transition phrase is forced (as reasoning) before the end marker.
        (ThinkingPolicy(**SINGLE, budget=1, transition_token_ids=(30, 31), prompt_opened=True), [1, 2, 3, 4, 5],
         [1, 30, 31, 11, 5], [R, R, R, M, C], Phase.ANSWER, 3),
        # A model that never thinks stays content.
        (ThinkingPolicy(**SINGLE, budget=3), [1, 2, 3, 4, 5], [1, 2, 3, 4, 5], [C] * 5, Phase.BEFORE, 0),
    ],
)
def test_state_machine_table(policy, model, expected_out, expected_roles, phase, reasoning):
    out, roles, state = play(policy, model, steps=len(expected_out))
    assert out == expected_out
    assert roles == expected_roles
    assert state.phase == phase
    assert state.num_reasoning_tokens == reasoning


def test_held_tokens_are_resolved_only_when_decided():
    policy = ThinkingPolicy(**MULTI, prompt_opened=True)
    state = initial_state(policy)
    state, roles = advance(policy, state, 20)
    assert roles == () and state.matched == 1
    state, roles = advance(policy, state, 23)
    assert roles == () and state.matched == 2
    state, roles = advance(policy, state, 8)  # not the marker: all three are reasoning
    assert roles == (R, R, R) and state.matched == 0 and state.num_reasoning_tokens == 3


@pytest.mark.parametrize("budget", [0, 1, 7, 64])
def test_single_token_markers_give_exactly_the_budget(budget):
    policy = ThinkingPolicy(**SINGLE, budget=budget, prompt_opened=True)
    out, roles, state = play(policy, [1, 2, 3] * 100, steps=budget + 5)
    assert roles == [R] * budget + [M] + [C] * 4
    assert out[budget] == 11 and state.num_reasoning_tokens == budget


@pytest.mark.parametrize("budget", [0, 1, 7, 64])
def test_reasoning_never_exceeds_the_budget(budget):
    policy = ThinkingPolicy(**MULTI, budget=budget, prompt_opened=True)
    model = [1, 20, 2, 20, 23, 5] * 40  # keeps thinking, with near-miss end markers
    out, roles, state = play(policy, model, steps=200)
    # A held near-miss at the boundary is taken as the end marker's start: one fewer.
    assert budget - 1 <= roles.count(R) <= budget
    assert state.phase == Phase.ANSWER
    end = roles.index(M)
    assert roles[end:end + 3] == [M, M, M] and all(r == C for r in roles[end + 3:])
