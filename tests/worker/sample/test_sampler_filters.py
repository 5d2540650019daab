"""Sampling filters and penalties against plain one-row-at-a-time references, on fixed logits."""

from __future__ import annotations

import math

import pytest
import torch

from spillway.protocol.messages import SamplingParams
from spillway.worker.sample.sampler import SamplingInput, apply_penalties, filtered_logits


def make_input(request_id: str = "r", prompt: list[int] | None = None,
               output: list[int] | None = None, **params) -> SamplingInput:
    return SamplingInput(request_id, SamplingParams(**params), prompt or [], output or [])


def fixed_logits(batch: int, vocab: int, seed: int = 0, scale: float = 2.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(batch, vocab, generator=generator) * scale


# ---- references: one row, plain Python over the vocabulary --------------------------------

def reference_penalised(row: torch.Tensor, prompt: list[int], output: list[int],
                        params: SamplingParams) -> torch.Tensor:
    row = row.clone()
    for token in set(prompt) | set(output):
        if row[token] > 0:
            row[token] = row[token] / params.repetition_penalty
        else:
            row[token] = row[token] * params.repetition_penalty
    for token in set(output):
        row[token] = row[token] - params.frequency_penalty * output.count(token)
        row[token] = row[token] - params.presence_penalty
    return row


def reference_probs(row: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution one sampled row draws from: temperature, top-k, top-p, min-p."""
    vocab = row.shape[0]
    scaled = (row / params.temperature).tolist()
    keep = [True] * vocab

    def renormalised() -> list[float]:
        weights = [math.exp(x - max(scaled)) if k else 0.0 for x, k in zip(scaled, keep)]
        return [w / sum(weights) for w in weights]

    if params.top_k > 0:
        kth_largest = sorted(scaled, reverse=True)[min(params.top_k, vocab) - 1]
        keep = [k and x >= kth_largest for x, k in zip(scaled, keep)]
    if params.top_p < 1.0:
        probs = renormalised()
        cumulative, nucleus = 0.0, set()
        for token in sorted(range(vocab), key=lambda t: -probs[t]):
            if cumulative >= params.top_p:
                break
            nucleus.add(token)
            cumulative += probs[token]
        keep = [k and t in nucleus for t, k in enumerate(keep)]
    if params.min_p > 0.0:
        probs = renormalised()
        keep = [k and p >= params.min_p * max(probs) for p, k in zip(probs, keep)]
    return torch.tensor(renormalised(), dtype=torch.float32)


def assert_same_distribution(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert (actual > 0).tolist() == (expected > 0).tolist()
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)


def support(probs: torch.Tensor) -> set[int]:
    return set(torch.nonzero(probs > 0).flatten().tolist())


# ---- filters and penalties against the references -----------------------------------------

FILTER_CASES = [
    dict(temperature=1.0),
    dict(temperature=0.5),
    dict(temperature=2.5),
    dict(top_k=1),
    dict(top_k=5),
    dict(top_k=0),
    dict(top_k=-1),
    dict(top_k=1000),
    dict(top_p=0.05),
    dict(top_p=0.5),
    dict(top_p=0.9),
    dict(min_p=0.1),
    dict(min_p=0.5),
    dict(temperature=0.7, top_k=8, top_p=0.8, min_p=0.05),
    dict(temperature=1.3, top_k=12, top_p=0.6),
    dict(temperature=0.9, top_p=0.95, min_p=0.2),
]


@pytest.mark.parametrize("vocab", [17, 64])
def test_filters_match_the_reference_row_by_row(vocab):
    params = [SamplingParams(**case) for case in FILTER_CASES]
    logits = fixed_logits(len(params), vocab, seed=vocab)
    probs = filtered_logits(logits, params).softmax(dim=-1)
    for row, row_params in enumerate(params):
        expected = reference_probs(logits[row], row_params)
        assert_same_distribution(probs[row], expected)


def test_filters_actually_drop_tokens():
    logits = fixed_logits(1, 40, seed=3)
    for case, kept in [(dict(top_k=5), 5), (dict(top_p=0.3), None), (dict(min_p=0.3), None)]:
        probs = filtered_logits(logits, [SamplingParams(**case)]).softmax(dim=-1)
        assert 1 <= len(support(probs[0])) < 40
        if kept is not None:
            assert len(support(probs[0])) == kept


def test_top_k_keeps_tokens_tied_with_the_kth():
    logits = torch.tensor([[1.0, 3.0, 2.0, 3.0, 2.0, 0.0]])
    probs = filtered_logits(logits, [SamplingParams(top_k=3)]).softmax(dim=-1)
    assert support(probs[0]) == {1, 2, 3, 4}
    assert_same_distribution(probs[0], reference_probs(logits[0], SamplingParams(top_k=3)))


def test_top_p_keeps_the_smallest_set_reaching_p_and_always_the_top_token():
    logits = torch.tensor([[0.5, 0.3, 0.2]]).log()
    assert support(filtered_logits(logits, [SamplingParams(top_p=0.5)]).softmax(-1)[0]) == {0}
    assert support(filtered_logits(logits, [SamplingParams(top_p=0.51)]).softmax(-1)[0]) == {0, 1}
    assert support(filtered_logits(logits, [SamplingParams(top_p=1e-6)]).softmax(-1)[0]) == {0}


def test_min_p_is_relative_to_the_most_likely_token():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    probs = filtered_logits(logits, [SamplingParams(min_p=0.3)]).softmax(dim=-1)
    assert support(probs[0]) == {0, 1, 2}


def test_min_p_applies_after_top_p():
    # min-p first would renormalise away the tail and let top-p stop one token earlier.
    logits = torch.tensor([[0.3, 0.26, 0.24, 0.04, 0.04, 0.04, 0.04, 0.04]]).log()
    params = SamplingParams(top_p=0.6, min_p=0.5)
    probs = filtered_logits(logits, [params]).softmax(dim=-1)
    assert support(probs[0]) == {0, 1, 2}
    assert_same_distribution(probs[0], reference_probs(logits[0], params))


def test_penalties_match_the_reference_row_by_row():
    vocab = 23
    inputs = [
        make_input(prompt=[1, 4, 4, 9], output=[4, 5, 5, 5, 17], repetition_penalty=1.3),
        make_input(prompt=[1, 4], output=[4, 5, 5, 5, 17], frequency_penalty=0.7),
        make_input(prompt=[1, 4], output=[4, 5, 5, 5, 17], presence_penalty=1.1),
        make_input(prompt=[0, 3, 8], output=[3, 3, 21, 22, 8], repetition_penalty=0.8,
                   frequency_penalty=-0.4, presence_penalty=0.5),
        make_input(prompt=[6, 7], output=[6, 7, 7]),
    ]
    logits = fixed_logits(len(inputs), vocab, seed=11)
    penalised = apply_penalties(logits, inputs)
    for row, i in enumerate(inputs):
        expected = reference_penalised(logits[row], list(i.prompt_token_ids),
                                       list(i.output_token_ids), i.params)
        torch.testing.assert_close(penalised[row], expected, rtol=1e-6, atol=1e-6)
    assert not torch.equal(penalised[:4], logits[:4])
    assert torch.equal(penalised[4], logits[4])


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0]])
    inputs = [make_input(prompt=[0], output=[1], repetition_penalty=2.0)]
    assert apply_penalties(logits, inputs).tolist() == [[1.0, -4.0, 2.0, -2.0]]
    assert logits.tolist() == [[2.0, -2.0, 2.0, -2.0]]
