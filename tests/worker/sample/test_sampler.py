"""The sampler end to end: greedy and seeded draws, min_tokens, logprobs and forced tokens."""

from __future__ import annotations

import pytest
import torch
from tests.worker.sample.test_sampler_filters import FILTER_CASES, fixed_logits, make_input, reference_probs, support

from spillway.protocol.messages import SamplingParams
from spillway.worker.sample.sampler import Sampler, SamplingInput, adjusted_logits, filtered_logits

EOS = 2


def test_greedy_equals_argmax_with_and_without_the_fast_path():
    logits = fixed_logits(5, 31, seed=1)
    expected = logits.argmax(dim=-1).tolist()
    plain = [make_input(f"r{b}", temperature=0.0) for b in range(5)]
    with_logprobs = [make_input(f"r{b}", temperature=0.0, logprobs=1) for b in range(5)]
    sampler = Sampler([EOS])
    assert [t.token_id for t in sampler.sample(logits, plain)] == expected
    assert [t.token_id for t in sampler.sample(logits, with_logprobs)] == expected


def test_greedy_picks_the_argmax_of_the_penalised_logits():
    logits = torch.tensor([[1.0, 3.0, 2.9, 0.0]])
    inputs = [make_input(output=[1], temperature=0.0, presence_penalty=0.5)]
    assert Sampler([EOS]).sample(logits, inputs)[0].token_id == 2


def test_temperature_scales_the_distribution():
    logits = fixed_logits(1, 9, seed=2)
    for temperature in (0.25, 1.0, 4.0):
        probs = filtered_logits(logits, [SamplingParams(temperature=temperature)]).softmax(-1)
        torch.testing.assert_close(probs[0], (logits[0] / temperature).softmax(-1))
    cold = filtered_logits(logits, [SamplingParams(temperature=0.25)]).softmax(-1)
    assert cold.max() > logits.softmax(-1).max()


@pytest.mark.parametrize("case", FILTER_CASES[3:], ids=str)
def test_sampled_tokens_only_come_from_the_allowed_set(case):
    batch, vocab = 300, 40
    row = fixed_logits(1, vocab, seed=5, scale=1.0)
    params = SamplingParams(**case)
    allowed = support(reference_probs(row[0], params))
    inputs = [make_input(f"r{b}", **case) for b in range(batch)]
    tokens = {t.token_id for t in Sampler([EOS], seed=1).sample(row.expand(batch, vocab), inputs)}
    assert tokens <= allowed
    if len(allowed) > 3:
        assert len(tokens) > 1


def test_sampled_frequencies_match_the_probabilities():
    probs = torch.tensor([0.05, 0.1, 0.2, 0.3, 0.35])
    draws = 4000
    logits = probs.log().expand(draws, 5)
    inputs = [make_input(f"r{b}") for b in range(draws)]
    tokens = [t.token_id for t in Sampler([99], seed=123).sample(logits, inputs)]
    frequencies = torch.bincount(torch.tensor(tokens), minlength=5).float() / draws
    torch.testing.assert_close(frequencies, probs, rtol=0, atol=0.025)


def test_one_seeded_request_over_many_steps_follows_the_filtered_distribution():
    logits = torch.tensor([[0.05, 0.1, 0.2, 0.3, 0.35]]).log()
    sampler = Sampler([99])
    inputs = [make_input("seeded", seed=42, temperature=0.8, top_k=4)]
    draws = 2000
    tokens = [sampler.sample(logits, inputs)[0].token_id for _ in range(draws)]
    frequencies = torch.bincount(torch.tensor(tokens), minlength=5).float() / draws
    expected = reference_probs(logits[0], inputs[0].params)
    assert frequencies[0] == 0
    torch.testing.assert_close(frequencies, expected, rtol=0, atol=0.035)


def run_steps(sampler: Sampler, logits: torch.Tensor, inputs: list[SamplingInput],
              steps: int) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {i.request_id: [] for i in inputs}
    for _ in range(steps):
        for i, token in zip(inputs, sampler.sample(logits, inputs)):
            tokens[i.request_id].append(token.token_id)
    return tokens


def test_a_seeded_request_is_the_same_in_any_batch_and_any_sampler():
    vocab, steps = 50, 20
    row = fixed_logits(1, vocab, seed=8, scale=0.5)
    seeded = make_input("seeded", seed=1234, top_p=0.9)
    alone = run_steps(Sampler([EOS], seed=0), row, [seeded], steps)["seeded"]

    neighbours = [make_input("greedy", temperature=0.0), make_input("other", seed=99),
                  make_input("unseeded", top_k=5)]
    batch = [neighbours[0], seeded, neighbours[1], neighbours[2]]
    in_batch = run_steps(Sampler([EOS], seed=7), row.expand(4, vocab), batch, steps)["seeded"]
    reordered = [neighbours[2], neighbours[1], seeded, neighbours[0]]
    in_reordered = run_steps(Sampler([EOS], seed=3), row.expand(4, vocab), reordered, steps)
    assert alone == in_batch == in_reordered["seeded"]
    assert len(set(alone)) > 5


def test_different_seeds_give_different_tokens():
    row = fixed_logits(1, 50, seed=8, scale=0.5)
    first = run_steps(Sampler([EOS]), row, [make_input("a", seed=1)], 20)["a"]
    second = run_steps(Sampler([EOS]), row, [make_input("a", seed=2)], 20)["a"]
    assert first != second


def test_unseeded_requests_are_reproducible_from_the_sampler_seed():
    logits = fixed_logits(6, 50, seed=9, scale=0.5)
    inputs = [make_input(f"r{b}") for b in range(6)]
    first = run_steps(Sampler([EOS], seed=5), logits, inputs, 5)
    again = run_steps(Sampler([EOS], seed=5), logits, inputs, 5)
    other = run_steps(Sampler([EOS], seed=6), logits, inputs, 5)
    assert first == again
    assert first != other


def test_forget_restarts_a_seeded_request():
    row = fixed_logits(1, 50, seed=8, scale=0.5)
    sampler = Sampler([EOS])
    request = make_input("a", seed=3)
    first = run_steps(sampler, row, [request], 10)["a"]
    continued = run_steps(sampler, row, [request], 10)["a"]
    sampler.forget("a")
    restarted = run_steps(sampler, row, [request], 10)["a"]
    assert restarted == first != continued
    assert sampler.request_generators == {"a": sampler.request_generators["a"]}
    sampler.forget("a")
    sampler.forget("never-seen")
    assert sampler.request_generators == {}


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    logits = torch.tensor([[0.0, 1.0, 9.0, 3.0, 8.0, 2.0]])  # EOS=2, then stop id 4
    sampler = Sampler([EOS])

    def greedy(output: list[int], **params) -> int:
        request = make_input(output=output, temperature=0.0, stop_token_ids=(4,), **params)
        return sampler.sample(logits, [request])[0].token_id

    assert greedy([7, 7], min_tokens=3) == 3
    assert greedy([7, 7, 7], min_tokens=3) == EOS
    assert greedy([7, 7], min_tokens=3, ignore_eos=True) == 3
    assert greedy([7, 7], ignore_eos=True) == EOS
    assert greedy([7, 7], ignore_eos=True, logprobs=0) == EOS
    unmasked = adjusted_logits(logits, [make_input(ignore_eos=True, stop_token_ids=(4,))], [EOS])
    assert torch.equal(unmasked, logits)
    masked = adjusted_logits(logits, [make_input(min_tokens=1, stop_token_ids=(4,))], [EOS])
    assert masked[0, EOS] == masked[0, 4] == float("-inf")
    assert logits[0, EOS] == 9.0

    sampled = [make_input(f"r{b}", output=[1], min_tokens=2, stop_token_ids=(4,)) for b in range(200)]
    tokens = {t.token_id for t in sampler.sample(logits.expand(200, 6), sampled)}
    assert EOS not in tokens and 4 not in tokens and 3 in tokens


def test_logprobs_come_from_the_raw_logits():
    vocab = 13
    logits = fixed_logits(3, vocab, seed=4)
    inputs = [
        make_input("a", prompt=[0, 1], output=[2], temperature=0.0, logprobs=3,
                   repetition_penalty=1.5, presence_penalty=2.0),
        make_input("b", temperature=0.7, top_k=4, logprobs=0, seed=5),
        make_input("c", temperature=0.0),
    ]
    sampled = Sampler([EOS]).sample(logits, inputs)
    raw = logits.log_softmax(dim=-1)
    for row, n in [(0, 3), (1, 0)]:
        lp = sampled[row].logprobs
        token = sampled[row].token_id
        assert lp.token_id == token
        assert lp.logprob == pytest.approx(raw[row, token].item(), abs=1e-6)
        assert lp.rank == 1 + sorted(raw[row].tolist(), reverse=True).index(raw[row, token].item())
        expected_top = sorted(range(vocab), key=lambda t: -raw[row, t].item())[:n]
        assert lp.top_token_ids == expected_top
        assert lp.top_logprobs == pytest.approx([raw[row, t].item() for t in expected_top], abs=1e-6)
    assert sampled[2].logprobs is None
    assert len(sampled[0].logprobs.top_token_ids) == 3 and sampled[1].logprobs.top_token_ids == []


def test_logprob_rank_of_a_penalised_choice_is_its_raw_rank():
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0]])
    request = make_input(output=[1], temperature=0.0, logprobs=2, presence_penalty=5.0)
    token = Sampler([EOS]).sample(logits, [request])[0]
    assert token.token_id == 2
    assert token.logprobs.rank == 2
    assert token.logprobs.top_token_ids == [1, 2]
    assert token.logprobs.logprob == pytest.approx(logits.log_softmax(-1)[0, 2].item())


def test_mixed_batch_of_greedy_and_sampled_requests():
    vocab = 29
    logits = fixed_logits(6, vocab, seed=6)
    inputs = [
        make_input("g0", temperature=0.0),
        make_input("s1", top_k=3),
        make_input("g2", temperature=0.0, output=[5], frequency_penalty=1.0),
        make_input("s3", top_p=0.5, seed=1),
        make_input("s4", min_p=0.4, temperature=0.5),
        make_input("g5", temperature=0.0, logprobs=1),
    ]
    sampler = Sampler([EOS])
    adjusted = adjusted_logits(logits, inputs, [EOS])
    for _ in range(10):
        tokens = [t.token_id for t in sampler.sample(logits, inputs)]
        for row in (0, 2, 5):
            assert tokens[row] == adjusted[row].argmax().item()
        for row in (1, 3, 4):
            assert tokens[row] in support(reference_probs(logits[row], inputs[row].params))


@pytest.mark.parametrize("vocab", [1, 2, 7, 1001])
def test_batch_of_one_and_odd_vocab_sizes(vocab):
    logits = fixed_logits(1, vocab, seed=vocab)
    sampler = Sampler([0])
    greedy = sampler.sample(logits, [make_input(temperature=0.0)])[0]
    assert greedy.token_id == logits[0].argmax().item()
    case = dict(top_k=3, top_p=0.9, min_p=0.01, logprobs=5, seed=1)
    sampled = sampler.sample(logits, [make_input(**case)])[0]
    assert sampled.token_id in support(reference_probs(logits[0], SamplingParams(**case)))
    assert len(sampled.logprobs.top_token_ids) == min(5, vocab)


def test_a_forced_token_wins_over_greedy_and_sampling_and_gets_its_logprob():
    logits = torch.tensor([[0.0, 5.0, 1.0, 2.0], [0.0, 5.0, 1.0, 2.0], [3.0, 0.0, 1.0, 2.0]])
    sampler = Sampler(eos_token_ids=[0], seed=0)
    inputs = [
        SamplingInput("greedy", SamplingParams(temperature=0.0), [1], [], forced_token_id=2),
        SamplingInput("sampled", SamplingParams(temperature=1.0, logprobs=1), [1], [], forced_token_id=3),
        SamplingInput("free", SamplingParams(temperature=0.0), [1], []),
    ]
    out = sampler.sample(logits, inputs)
    assert [s.token_id for s in out] == [2, 3, 0]
    expected = torch.log_softmax(logits[1], -1)[3].item()
    assert out[1].logprobs.token_id == 3 and abs(out[1].logprobs.logprob - expected) < 1e-6
    plain = sampler.sample(logits[:1], [SamplingInput("g", SamplingParams(temperature=0.0), [1], [],
                                                      forced_token_id=3)])
    assert plain[0].token_id == 3  # the all-greedy fast path forces too


def test_tiny_temperature_is_greedy_and_extreme_penalties_stay_finite():
    logits = torch.tensor([[0.5, 3.0, 1.0, 2.0]])
    sampler = Sampler(eos_token_ids=[0], seed=0)
    tiny = SamplingInput("t", SamplingParams(temperature=1e-300), [1], [])
    assert sampler.sample(logits, [tiny])[0].token_id == 1
    harsh = SamplingInput("p", SamplingParams(temperature=1.0, repetition_penalty=1e-300), [1], [3])
    token = sampler.sample(logits, [harsh])[0].token_id
    assert token in (1, 3)  # the penalised tokens blow up to the largest finite logit, never NaN
