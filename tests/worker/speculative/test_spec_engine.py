"""Speculative decoding through the engine's one step path, on the CPU over a tiny random
Qwen3: greedy outputs equal plain decoding token for token whatever the drafts (n-gram
lookup, random tokens, the true continuation), with prefix caching, a thinking budget, stop
tokens, min_tokens, penalties and logprobs in the same batch."""

from __future__ import annotations

import random

import pytest
import torch

from spillway.protocol.config import SpeculativeConfig
from spillway.protocol.messages import FinishReason, SamplingParams
from spillway.protocol.reasoning import ThinkingPolicy
from spillway.worker.runner.device_settings import WorkerConfig
from spillway.worker.driver.engine import Engine
from spillway.worker.speculative.proposer import NgramProposer, ReplayProposer

from tests.worker.spec_helpers import Job, RandomProposer, run, tokens_and_reasons
from tiny_models import TINY_VOCAB, TinyCheckpoints, save_tiny_qwen3, save_tiny_qwen3_moe

VOCAB = TINY_VOCAB
K = 4


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> TinyCheckpoints:
    return TinyCheckpoints(tmp_path_factory.mktemp("tiny-spec"),
                           {"qwen3": save_tiny_qwen3, "qwen3_moe": save_tiny_qwen3_moe})


@pytest.fixture
def tiny_model(request, checkpoints) -> str:
    """A tiny random Qwen3; a tiny Qwen3-MoE where a test asks for "qwen3_moe" (indirect)."""
    return checkpoints[getattr(request, "param", "qwen3")]


def make_engine(path: str, **overrides) -> Engine:
    config = dict(model=path, dtype="float32", device="cpu", max_num_seqs=8, block_size=8,
                  speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=K))
    config.update(overrides)
    return Engine(WorkerConfig(**config))


def greedy(**params) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": 30, "ignore_eos": True, **params})


def mixed_jobs() -> list[Job]:
    rng = random.Random(5)
    shared = [rng.randrange(3, VOCAB) for _ in range(20)]
    loop = [rng.randrange(3, VOCAB) for _ in range(6)] * 4  # n-gram lookup finds these
    policy = ThinkingPolicy(start_token_ids=(2,), end_token_ids=(3, 4), transition_token_ids=(5,), budget=6,
                            prompt_opened=True)
    return [
        Job("plain", loop, greedy()),
        Job("shared-a", shared + [7, 8], greedy(max_tokens=17)),
        Job("shared-b", shared + [9], greedy(), arrival_step=12),  # prefix-cache hits on shared-a's blocks
        Job("think", loop[:10], greedy(max_tokens=25), policy),
        Job("stop", loop[3:], greedy(stop_token_ids=[11, 12, 13])),
        Job("min", shared[:5], greedy(ignore_eos=False, min_tokens=9, max_tokens=40)),
        Job("penalised", loop[1:], greedy(presence_penalty=1.5, repetition_penalty=1.3, frequency_penalty=0.2)),
        Job("logprobs", loop[2:], greedy(logprobs=3, max_tokens=12), arrival_step=3),
    ]


@pytest.mark.parametrize("proposer_kind, tiny_model", [("ngram", "qwen3"), ("random", "qwen3"), ("replay", "qwen3"),
                                                      ("ngram", "qwen3_moe")], indirect=["tiny_model"])
def test_greedy_outputs_equal_plain_decoding_whatever_the_drafts(tiny_model, proposer_kind):
    jobs = mixed_jobs()
    expected = run(make_engine(tiny_model), jobs, None)
    proposer = {
        "ngram": NgramProposer(1, 3),
        "random": RandomProposer(VOCAB, seed=1),
        "replay": ReplayProposer({tuple(job.prompt): expected[job.request_id].tokens for job in jobs}),
    }[proposer_kind]
    engine = make_engine(tiny_model)
    got = run(engine, jobs, proposer)
    assert tokens_and_reasons(got) == tokens_and_reasons(expected)
    assert got["shared-b"].num_cached_tokens == expected["shared-b"].num_cached_tokens == 16
    assert got["think"].tokens[6:9] == [5, 3, 4]  # the budget: transition, then the end marker
    metrics = engine.spec.metrics
    assert metrics.num_draft_tokens > 0 and sum(metrics.accepted_per_position) == metrics.num_accepted_tokens
    if proposer_kind == "replay":
        assert metrics.num_accepted_tokens == metrics.num_draft_tokens
    if proposer_kind == "random":
        assert metrics.num_accepted_tokens < metrics.num_draft_tokens / 4
    for want, have in zip(expected["logprobs"].logprobs, got["logprobs"].logprobs):
        assert (have.token_id, have.rank, have.top_token_ids) == (want.token_id, want.rank, want.top_token_ids)
        assert have.logprob == pytest.approx(want.logprob, abs=1e-4)
    assert len(got["logprobs"].logprobs) == 12


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_true_continuation_needs_fewer_steps(tiny_model, async_scheduling):
    """With asynchronous scheduling too: a step that would speculate settles the step in flight first."""
    jobs = [Job("a", list(range(10, 30)), greedy(max_tokens=41))]
    plain_engine = make_engine(tiny_model, speculative=None, async_scheduling=async_scheduling)
    spec_engine = make_engine(tiny_model, async_scheduling=async_scheduling)
    expected = run(plain_engine, jobs, None)
    got = run(spec_engine, jobs, ReplayProposer({tuple(jobs[0].prompt): expected["a"].tokens}))
    assert got["a"].tokens == expected["a"].tokens
    # Prefill, then K + 1 tokens per step: 1 + 40 / 5 steps instead of 41.
    assert (plain_engine.num_steps, spec_engine.num_steps) == (41, 9)
    stats = spec_engine.stats()
    assert (stats.spec_num_drafts, stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens) == (8, 8 * K, 8 * K)
    assert stats.spec_num_accepted_tokens_per_pos == [8] * K
    assert plain_engine.stats().spec_num_accepted_tokens_per_pos == []


def test_a_run_is_cut_at_a_stop_token_and_at_max_tokens(tiny_model):
    """The replayed continuation runs past the stop: the tokens after it are never committed."""
    prompt = list(range(40, 60))
    free = run(make_engine(tiny_model), [Job("a", prompt, greedy(max_tokens=20))], None)["a"].tokens
    stop = free[6]
    first = free.index(stop)
    jobs = [Job("stop", prompt, greedy(stop_token_ids=[stop])), Job("short", prompt, greedy(max_tokens=3))]
    got = run(make_engine(tiny_model), jobs, ReplayProposer({tuple(prompt): free}))
    assert got["stop"].tokens == free[:first + 1] and got["stop"].finish_reason == FinishReason.STOP
    assert got["short"].tokens == free[:3] and got["short"].finish_reason == FinishReason.LENGTH


def test_seeded_sampling_repeats_itself_under_speculation_in_any_batch(tiny_model):
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=17, max_tokens=25, ignore_eos=True)
    jobs = [Job("s", [7, 8, 9] * 5, params), Job("t", [7] * 12, params)]
    neighbour = Job("u", [7, 8, 9] * 4, SamplingParams(temperature=1.0, max_tokens=25, ignore_eos=True))
    first = run(make_engine(tiny_model), jobs, NgramProposer(1, 2))
    second = run(make_engine(tiny_model, seed=5), [neighbour, *jobs], NgramProposer(1, 2))
    assert first["s"].tokens == second["s"].tokens and len(first["s"].tokens) == 25
    assert first["t"].tokens == second["t"].tokens


def test_speculation_with_asynchronous_scheduling_equals_plain_decoding(tiny_model):
    jobs = mixed_jobs()
    expected = run(make_engine(tiny_model, async_scheduling=False), jobs, None)
    engine = make_engine(tiny_model, async_scheduling=True)
    got = run(engine, jobs, NgramProposer(1, 2))
    assert tokens_and_reasons(got) == tokens_and_reasons(expected)


def save_tiny_model(path, vocab_size: int, seed: int) -> str:
    return save_tiny_qwen3(path, vocab_size=vocab_size, seed=seed, hidden_size=32, num_layers=1, num_heads=2)


def draft_engine(target: str, draft: str) -> Engine:
    return make_engine(target, speculative=SpeculativeConfig(method="draft_model", model=draft,
                                                             num_speculative_tokens=K))


@pytest.mark.parametrize("draft_kind, tiny_model", [("the-target", "qwen3"), ("another-model", "qwen3"),
                                                   ("the-target", "qwen3_moe"), ("another-model", "qwen3_moe")],
                         indirect=["tiny_model"])
def test_a_draft_model_gives_plain_greedy_outputs(tiny_model, tmp_path, draft_kind):
    draft = tiny_model if draft_kind == "the-target" else save_tiny_model(tmp_path / "draft", VOCAB, seed=3)
    jobs = mixed_jobs()
    expected = run(make_engine(tiny_model), jobs, None)
    engine = draft_engine(tiny_model, draft)
    got = run(engine, jobs, engine.spec.proposer)
    assert tokens_and_reasons(got) == tokens_and_reasons(expected)
    metrics = engine.spec.metrics
    assert metrics.num_accepted_tokens < metrics.num_draft_tokens  # penalties, budgets, another model: misses
    assert not engine.spec.proposer._sequences  # every finished request's draft blocks were released
    if draft_kind == "the-target":  # without penalties or forced tokens it proposes what the target decodes
        plain_jobs = [Job("a", list(range(100, 120)), greedy()), Job("b", [9, 8, 7], greedy(max_tokens=21))]
        engine = draft_engine(tiny_model, draft)
        assert tokens_and_reasons(run(engine, plain_jobs, engine.spec.proposer)) == tokens_and_reasons(
            run(make_engine(tiny_model), plain_jobs, None))
        # a: 29 tokens after prefill, 5 steps of K + 1 then 3 drafts + 1 (max_tokens); b: 20, 4 steps of K + 1.
        assert engine.spec.metrics.num_accepted_tokens == engine.spec.metrics.num_draft_tokens == 5 * K + 3 + 4 * K


def test_a_draft_model_samples_with_seeds_repeated(tiny_model):
    params = SamplingParams(temperature=0.8, top_k=40, seed=4, max_tokens=20, ignore_eos=True)
    jobs = [Job("s", list(range(30, 50)), params), Job("t", list(range(60, 70)), params)]
    outputs = []
    for _ in range(2):
        engine = draft_engine(tiny_model, tiny_model)
        outputs.append(tokens_and_reasons(run(engine, jobs, engine.spec.proposer)))
        assert engine.spec.metrics.num_accepted_tokens > 0
    assert outputs[0] == outputs[1]


def test_greedy_and_sampled_requests_share_a_draft_model_step(tiny_model):
    """Sampled requests carry the draft's q, greedy ones a point mass, in one verification."""
    greedy_job = Job("g", list(range(100, 116)), greedy(max_tokens=24))
    sampled = Job("s", list(range(200, 216)), SamplingParams(temperature=1.0, seed=2, max_tokens=24, ignore_eos=True))
    expected = run(make_engine(tiny_model), [greedy_job], None)
    engine = draft_engine(tiny_model, tiny_model)
    got = run(engine, [greedy_job, sampled], engine.spec.proposer)
    assert got["g"].tokens == expected["g"].tokens and len(got["s"].tokens) == 24
    assert engine.spec.metrics.num_accepted_tokens > 0


def test_a_draft_model_with_another_vocabulary_is_refused(tiny_model, tmp_path):
    other = save_tiny_model(tmp_path / "other-vocab", VOCAB // 2, seed=1)
    with pytest.raises(ValueError, match="vocabulary has 192 tokens and the target's 384"):
        draft_engine(tiny_model, other)
