"""Speculative decoding on the real default model (SmolLM2-135M-Instruct, fp32, CPU): greedy
outputs equal plain decoding token for token for n-gram lookup, random drafts and the true
continuation, with prefix caching on; a thinking budget of 0, 1, 7 or 64 closes thinking at
exactly the same token and gives the same answer with speculation as without, even when the
drafts run on past the budget."""

from __future__ import annotations

import pytest

from spillway.protocol.local import model_files
from spillway.protocol.config import SpeculativeConfig
from spillway.protocol.messages import SamplingParams
from spillway.protocol.reasoning import ThinkingPolicy
from spillway.worker.runner.device_settings import WorkerConfig
from spillway.worker.driver.engine import Engine
from spillway.worker.speculative.draft_model import DraftModelProposer
from spillway.worker.speculative.proposer import NgramProposer, ReplayProposer

from tests.worker.spec_helpers import Job, RandomProposer, run, tokens_and_reasons

TEXTS = [
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The quick",
    "List the days of the week: Monday, Tuesday, Wednesday,",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
]
# Marker ids the model is unlikely to write by itself: "<think>", "</think>" and a transition.
START, END, TRANSITION = (28,), (1010, 1011), (30,)


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(WorkerConfig(dtype="float32", device="cpu", max_num_seqs=8, max_model_len=1024,
                               speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=4)))


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    tokenizer = model_files.load_tokenizer(model_files.resolve_model(None))
    return [tokenizer(text, add_special_tokens=False)["input_ids"] for text in TEXTS]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def draft_equal_to_target(engine: Engine) -> DraftModelProposer:
    """The default model again, as its own draft."""
    return DraftModelProposer.load(str(model_files.default_model_path()), target_vocab_size=engine.vocab_size,
                                   device=engine.device, dtype=engine.dtype, max_model_len=engine.max_model_len,
                                   max_num_seqs=8, block_size=engine.block_size,
                                   max_num_batched_tokens=engine.max_num_batched_tokens, num_speculative_tokens=4)


@pytest.fixture(scope="module")
def greedy_plainly(engine, prompts) -> tuple[list[Job], dict]:
    jobs = [Job(f"r{i}", prompt, greedy(28), arrival_step=2 * i) for i, prompt in enumerate(prompts)]
    return jobs, run(engine, jobs, None)


@pytest.mark.parametrize("proposer_kind", ["ngram", "random", "replay", "draft-equal-to-target"])
def test_greedy_outputs_equal_plain_decoding(engine, greedy_plainly, proposer_kind):
    jobs, expected = greedy_plainly
    if proposer_kind == "draft-equal-to-target":
        proposer = draft_equal_to_target(engine)
    else:
        proposer = {"ngram": NgramProposer(1, 4), "random": RandomProposer(engine.vocab_size, seed=3),
                    "replay": ReplayProposer({tuple(j.prompt): expected[j.request_id].tokens for j in jobs})
                    }[proposer_kind]
    metrics = engine.spec.metrics
    drafted_before, accepted_before = metrics.num_draft_tokens, metrics.num_accepted_tokens
    got = run(engine, jobs, proposer)
    assert tokens_and_reasons(got) == tokens_and_reasons(expected)
    assert got["r0"].num_cached_tokens > 0  # the plain run's blocks, hashed from committed tokens
    drafted, accepted = metrics.num_draft_tokens - drafted_before, metrics.num_accepted_tokens - accepted_before
    if proposer_kind in ("replay", "draft-equal-to-target"):
        assert accepted == drafted > 20
    elif proposer_kind == "ngram":
        assert accepted >= 15


BUDGETS = (0, 1, 7, 64)


def budget_jobs(prompt: list[int], budget_of) -> list[Job]:
    """One request per budget (its prompt ends with its budget); `budget_of(b)` is the budget
    its policy gets (None: think freely)."""
    num_answer = 10
    return [Job(f"b{b}", prompt + [b], greedy(b + len(TRANSITION) + len(END) + num_answer),
                ThinkingPolicy(start_token_ids=START, end_token_ids=END, transition_token_ids=TRANSITION,
                               budget=budget_of(b), prompt_opened=True)) for b in BUDGETS]


@pytest.fixture(scope="module")
def budgeted_plainly(engine, prompts):
    expected = run(engine, budget_jobs(prompts[0], lambda b: b), None)
    for budget in BUDGETS:
        tokens = expected[f"b{budget}"].tokens
        assert tokens[budget:budget + 3] == [*TRANSITION, *END]
        assert END[0] not in tokens[:budget]
    return expected


@pytest.mark.parametrize("proposer_kind", ["ngram", "unbudgeted-replay"])
def test_a_thinking_budget_closes_thinking_at_the_same_token(engine, prompts, budgeted_plainly, proposer_kind):
    if proposer_kind == "ngram":
        proposer = NgramProposer(1, 4)
    else:  # drafts from free thinking: they run on past the budget, where the end is forced
        free = run(engine, budget_jobs(prompts[0], lambda b: None), None)
        assert all(END[0] not in free[f"b{b}"].tokens for b in BUDGETS)
        proposer = ReplayProposer({(*prompts[0], b): free[f"b{b}"].tokens for b in BUDGETS})
    got = run(engine, budget_jobs(prompts[0], lambda b: b), proposer)
    assert tokens_and_reasons(got) == tokens_and_reasons(budgeted_plainly)
