"""Exact rejection sampling (worker/speculative/rejection.py) without a model: the committed tokens
have the target's distribution whatever the draft's, greedy requests take the target's argmax
run, and seeded requests repeat themselves in any batch."""

from __future__ import annotations

import math

import pytest
import torch

from spillway.protocol.messages import SamplingParams
from spillway.worker.sample.sampler import Sampler, SamplingInput
from spillway.worker.speculative.rejection import RejectionSampler, target_probs

VOCAB = 6
K = 3


def make_input(request_id: str, **params) -> SamplingInput:
    return SamplingInput(request_id, SamplingParams(**{"temperature": 1.0, **params}), [1, 2], [])


def tv_bound(p: torch.Tensor, num_samples: int, delta: float = 1e-6) -> float:
    """A bound the empirical total-variation distance from p exceeds with probability < delta:
    its mean is at most 0.5 * sum sqrt(p (1 - p) / n), and one sample moves it by at most 1/n
    (McDiarmid: P(TV - E[TV] > t) <= exp(-2 n t^2))."""
    mean = 0.5 * float((p * (1 - p) / num_samples).sqrt().sum())
    return mean + math.sqrt(math.log(1 / delta) / (2 * num_samples))


def tv_distance(tokens: torch.Tensor, p: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=p.numel()).double()
    return 0.5 * float((counts / counts.sum() - p.double()).abs().sum())


@pytest.mark.parametrize("point_mass_drafts", [False, True])
def test_committed_tokens_follow_the_target_distribution(point_mass_drafts):
    """200k requests, each K drafts drawn from q (or fixed drafts, a point mass); the first
    and second committed tokens of the runs against p of their positions."""
    num_requests = 200_000
    gen = torch.Generator().manual_seed(7)
    # Position-wise p and q that disagree a lot; q puts mass where p has none and vice versa.
    p = torch.tensor([[0.40, 0.25, 0.15, 0.10, 0.10, 0.00],
                      [0.05, 0.05, 0.50, 0.20, 0.00, 0.20],
                      [0.30, 0.30, 0.10, 0.10, 0.10, 0.10],
                      [0.10, 0.20, 0.30, 0.20, 0.10, 0.10]])
    q = torch.tensor([[0.10, 0.30, 0.10, 0.10, 0.10, 0.30],
                      [0.30, 0.30, 0.10, 0.00, 0.20, 0.10],
                      [0.10, 0.10, 0.40, 0.20, 0.10, 0.10]])
    if point_mass_drafts:
        fixed = torch.tensor([1, 2, 0])
        drafts = fixed.expand(num_requests, K)
        q = torch.nn.functional.one_hot(fixed, VOCAB).float()
        draft_probs = None
    else:
        drafts = torch.stack([torch.multinomial(q[j], num_requests, replacement=True, generator=gen)
                              for j in range(K)], dim=1)
        draft_probs = q.repeat(num_requests, 1)
    probs = p.repeat(num_requests, 1)
    sampler = Sampler([], seed=3)
    inputs = [make_input(f"r{i}") for i in range(num_requests)]
    verified = RejectionSampler(sampler).verify(probs, inputs, [K] * num_requests, drafts.flatten().tolist(),
                                                draft_probs)
    accepted, final = verified.num_accepted, verified.token_ids
    first = torch.where(accepted >= 1, drafts[:, 0], final)
    assert tv_distance(first, p[0]) < tv_bound(p[0], num_requests)
    second_exists = accepted >= 1
    second = torch.where(accepted >= 2, drafts[:, 1], final)[second_exists]
    assert second.numel() > 20_000
    assert tv_distance(second, p[1]) < tv_bound(p[1], second.numel())
    # The acceptance rate of the first position is sum min(p, q).
    expected = float(torch.minimum(p[0], q[0]).sum())
    assert abs(float((accepted >= 1).double().mean()) - expected) < 5 * math.sqrt(0.25 / num_requests)


def test_greedy_requests_accept_while_the_draft_is_the_argmax():
    logits = torch.full((3 * (K + 1), VOCAB), -1.0)
    argmax = [[2, 4, 1, 5], [0, 0, 0, 0], [3, 1, 4, 1]]
    for request, row_tokens in enumerate(argmax):
        for position, token in enumerate(row_tokens):
            logits[request * (K + 1) + position, token] = 3.0
    drafts = [2, 4, 0,  # rejected at position 2: the argmax 1 is taken there
              0, 0, 0,  # all accepted: the bonus is the argmax of the last row
              5, 1, 4]  # rejected at once
    inputs = [make_input(f"g{i}", temperature=0.0) for i in range(3)]
    rows = [i for i in inputs for _ in range(K + 1)]
    probs = target_probs(logits, rows, [])
    verified = RejectionSampler(Sampler([])).verify(probs, inputs, [K] * 3, drafts)
    assert verified.num_accepted.tolist() == [2, 3, 0]
    assert verified.token_ids.tolist() == [1, 0, 3]


def test_requests_with_fewer_drafts_and_none_share_a_batch():
    logits = torch.zeros(1 + 3 + 2, VOCAB)
    for row, token in enumerate([4, 1, 2, 3, 5, 0]):
        logits[row, token] = 5.0
    inputs = [make_input(f"g{i}", temperature=0.0) for i in range(3)]
    rows = [inputs[0], inputs[1], inputs[1], inputs[1], inputs[2], inputs[2]]
    probs = target_probs(logits, rows, [])
    verified = RejectionSampler(Sampler([])).verify(probs, inputs, [0, 2, 1], [1, 2, 5])
    assert verified.num_accepted.tolist() == [0, 2, 1]
    assert verified.token_ids.tolist() == [4, 3, 0]


def test_a_forced_token_is_the_target_whatever_the_logits():
    logits = torch.zeros(K + 1, VOCAB)
    logits[:, 0] = 9.0
    free = make_input("f", temperature=0.7)
    forced = SamplingInput("f", free.params, [1], [], forced_token_id=5)
    probs = target_probs(logits, [forced, free, free, free], [])
    assert probs[0].tolist() == [0, 0, 0, 0, 0, 1]
    verified = RejectionSampler(Sampler([])).verify(probs, [free], [K], [3, 0, 0])
    assert verified.num_accepted.tolist() == [0] and verified.token_ids.tolist() == [5]


def test_a_seeded_request_repeats_its_tokens_in_any_batch():
    p = torch.softmax(torch.randn(K + 1, VOCAB, generator=torch.Generator().manual_seed(1)), dim=-1)
    seeded = make_input("s", seed=11)

    def run(batch_before: int):
        others = [make_input(f"o{i}") for i in range(batch_before)]
        inputs = others + [seeded]
        probs = torch.cat([p] * (batch_before + 1))
        drafts = [1, 2, 3] * (batch_before + 1)
        sampler = Sampler([], seed=batch_before)  # a different shared generator each time
        verified = RejectionSampler(sampler).verify(probs, inputs, [K] * len(inputs), drafts)
        return verified.num_accepted[-1].item(), verified.token_ids[-1].item()

    outcomes = {run(n) for n in (0, 1, 5)}
    assert len(outcomes) == 1


def test_the_argmax_verification_of_plain_greedy_rows_is_the_general_one():
    """`verify_argmax` (one kernel, for plain greedy rows with point-mass drafts) against
    `verify` over the same rows: the same accepted counts and final tokens, drafts of every
    length, drafts that are the argmax more often than chance."""
    generator = torch.Generator().manual_seed(11)
    sampler = RejectionSampler(Sampler([]))
    for trial in range(50):
        num_drafts = torch.randint(0, 6, (4,), generator=generator).tolist()
        logits = torch.randn(sum(num_drafts) + 4, VOCAB, generator=generator)
        argmax = logits.argmax(dim=-1).tolist()
        drafts, row = [], 0
        for count in num_drafts:
            for position in range(count):  # the argmax two times in three, else a random token
                keep = torch.rand(1, generator=generator).item() < 0.67
                drafts.append(argmax[row + position] if keep else int(torch.randint(VOCAB, (1,), generator=generator)))
            row += count + 1
        inputs = [make_input(f"g{i}", temperature=0.0) for i in range(4)]
        rows = [inputs[i] for i, count in enumerate(num_drafts) for _ in range(count + 1)]
        general = sampler.verify(target_probs(logits, rows, []), inputs, num_drafts, drafts)
        fast = RejectionSampler.verify_argmax(logits, num_drafts, drafts)
        assert fast.num_accepted.tolist() == general.num_accepted.tolist(), trial
        assert fast.token_ids.tolist() == general.token_ids.tolist(), trial
