"""The scheduler's prefix cache: hits on shared prompts and generated blocks, and the counters."""

from __future__ import annotations

import pytest
from tests.worker.core.test_scheduler import Harness, chunks


@pytest.mark.parametrize("num_prompt_tokens, num_cached", [(32, 16), (33, 32), (31, 16), (16, 0)])
def test_a_prefix_hit_always_recomputes_the_last_prompt_token(num_prompt_tokens, num_cached):
    harness = Harness(block_size=16, num_blocks=16, max_model_len=128)
    prompt = list(range(num_prompt_tokens))
    harness.add("a", prompt, max_tokens=1)
    harness.run()
    harness.add("b", prompt, max_tokens=2)
    plan, results = harness.step()
    ((_, start, num_tokens, slot_table, sample),) = chunks(plan)
    assert (start, num_tokens, sample) == (num_cached, num_prompt_tokens - num_cached, True)
    assert results[0].num_cached_tokens == num_cached
    assert harness.results["a"][0].num_cached_tokens == 0
    assert harness.scheduler.counts.prefix_cache_queries == 2 * num_prompt_tokens
    assert harness.scheduler.counts.prefix_cache_hits == num_cached
    assert harness.step()[1][0].num_cached_tokens == -1  # only the first output carries it


def test_a_shared_system_prompt_hits_across_different_questions():
    harness = Harness()
    system = [7, 7, 7, 7, 8, 8, 8, 8, 9]  # two full blocks and one token
    harness.add("a", system + [50, 51])
    plan_a, _ = harness.step()
    harness.add("b", system + [60, 61, 62, 63, 64])
    harness.add("c", [1] + system)
    plan_b, results = harness.step()
    table_a = plan_a.chunks[0].slot_table
    assert chunks(plan_b) == [("a", 11, 1, table_a, True), ("b", 8, 6, table_a[:2] + [3, 4], True),
                              ("c", 0, 10, [5, 6, 7], True)]
    assert [r.num_cached_tokens for r in results[1:]] == [8, 0]
    blocks_a = [harness.manager.blocks[i] for i in harness.manager.block_ids("a")]
    assert [block.gpu_slot for block in blocks_a] == table_a
    assert [block.ref_count for block in blocks_a] == [2, 2, 1]
    assert harness.scheduler.counts.prefix_cache_hits == 8


@pytest.mark.parametrize("hashed_by_gateway", [True, False])
def test_blocks_completed_by_generated_tokens_are_committed_and_hit(hashed_by_gateway):
    harness = Harness()
    harness.add("a", list(range(6)), max_tokens=6, hashed=hashed_by_gateway)
    harness.run()
    # 12 tokens, 11 computed: blocks 0 and 1 (tokens 6 and 7 generated) are cached.
    a_tokens = harness.results["a"][-1].request.all_token_ids
    harness.add("b", a_tokens, max_tokens=1)
    plan, results = harness.step()
    assert chunks(plan) == [("b", 8, 4, [0, 1, 2], True)]  # a's partial block 2 is reused first
    assert results[0].num_cached_tokens == 8


def test_with_prefix_caching_off_nothing_hits_or_counts():
    harness = Harness(enable_prefix_caching=False)
    for request_id in "ab":
        harness.add(request_id, list(range(12)), max_tokens=2)
        harness.run()
    assert [harness.results[i][0].num_cached_tokens for i in "ab"] == [0, 0]
    assert (harness.scheduler.counts.prefix_cache_queries, harness.scheduler.counts.prefix_cache_hits) == (0, 0)
