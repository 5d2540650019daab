"""Prefix caching on mixture-of-experts models (tiny random Qwen3-MoE, Mixtral, and DeepSeek V2
and V3, whose latent attention keeps a one-sided KV cache; float32, on the CPU): a request that shares a long prefix with an earlier one computes only what follows
the cached blocks, in chunks, and decodes what an engine without a cache decodes.

The other engine features are shown on a Qwen3-MoE beside their dense tests: the CPU tier
(kv_tier/test_cpu_tier_engine.py), asynchronous scheduling (test_async_scheduling.py),
speculation (speculative/test_spec_engine.py), chunked prefill against transformers
(models/test_moe_models.py)."""

from __future__ import annotations

import random

import pytest

from spillway.protocol.config import WorkerConfig
from spillway.protocol.messages import SamplingParams
from spillway.worker.driver.engine import Engine

from tests.worker.spec_helpers import Job, run
from tiny_models import (
    TINY_VOCAB,
    save_tiny_deepseek_v2,
    save_tiny_deepseek_v3,
    save_tiny_mixtral,
    save_tiny_qwen3_moe,
)

FAMILIES = {"qwen3_moe": save_tiny_qwen3_moe, "mixtral": save_tiny_mixtral,
            "deepseek_v2": save_tiny_deepseek_v2, "deepseek_v3": save_tiny_deepseek_v3}
BLOCK_SIZE = 16


@pytest.fixture(scope="module", params=FAMILIES)
def moe_model(request, tmp_path_factory) -> str:
    return FAMILIES[request.param](tmp_path_factory.mktemp(request.param))


def make_engine(path: str, **overrides) -> Engine:
    config = dict(model=path, dtype="float32", device="cpu", max_num_seqs=4, block_size=BLOCK_SIZE)
    return Engine(WorkerConfig(**{**config, **overrides}))


def shared_prefix_jobs() -> list[Job]:
    """Two questions after one 45-token prefix (two full blocks and 13 tokens); the second
    arrives once the first's prompt is computed, and a third shares nothing."""
    rng = random.Random(3)
    prefix = [rng.randrange(2, TINY_VOCAB) for _ in range(45)]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    return [Job("first", prefix + [7, 8, 9], greedy),
            Job("second", prefix + [10, 11], greedy, arrival_step=6),
            Job("unrelated", [rng.randrange(2, TINY_VOCAB) for _ in range(20)], greedy, arrival_step=6)]


def test_a_shared_prefix_is_computed_once_chunked_with_the_tokens_of_an_engine_without_a_cache(moe_model):
    jobs = shared_prefix_jobs()
    cached_engine = make_engine(moe_model, max_num_batched_tokens=16)  # a 48-token prompt takes 3 steps
    got = run(cached_engine, jobs, None)
    expected = run(make_engine(moe_model, enable_prefix_caching=False), jobs, None)

    assert {rid: outcome.tokens for rid, outcome in got.items()} == {
        rid: outcome.tokens for rid, outcome in expected.items()}
    assert {rid: outcome.num_cached_tokens for rid, outcome in got.items()} == {
        "first": 0, "second": 2 * BLOCK_SIZE, "unrelated": 0}
    assert all(outcome.num_cached_tokens == 0 for outcome in expected.values())
    stats = cached_engine.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (48 + 47 + 20, 2 * BLOCK_SIZE)
