"""A draft model's KV pool is sized from the target's budget: both pools hold the same number
of tokens, in proportion to their bytes per token; where they cannot hold one request, the
message names the setting to change, as the caller spells it, and the value that fits."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from spillway.protocol.config import WorkerConfig
from spillway.worker.runner.kv_blocks import kv_block_bytes
from spillway.worker.runner.kv_budget import KVBudget, shared_pool_blocks, shortfall_message

GIB = 1 << 30
ARGUMENTS, FLAGS = WorkerConfig().spell, WorkerConfig(settings_spelling="flags").spell


def block_bytes(layers: int, kv_heads: int, head_dim: int, itemsize: int = 4, block_size: int = 16) -> int:
    return layers * 2 * block_size * kv_heads * head_dim * itemsize


SMOLLM2 = block_bytes(30, 3, 64)  # SmolLM2-135M in fp32: 46,080 bytes a token
TINY_DRAFT = block_bytes(2, 1, 64)  # a two-layer draft with one KV head


def sizes(budget: KVBudget, target: int, draft: int, *, max_model_len: int = 8192, k: int = 5,
          max_num_seqs: int = 256, spell=ARGUMENTS) -> int:
    return shared_pool_blocks(budget, target_block_bytes=target, draft_block_bytes=draft, block_size=16,
                              max_model_len=max_model_len, num_speculative_tokens=k, max_num_seqs=max_num_seqs,
                              spell=spell)


def test_smollm2_drafting_for_itself_on_the_cpu_splits_the_gib_in_halves():
    # 1 GiB over 2 x 737,280 bytes a block: 728 blocks each, 11,648 tokens, more than 8,192 + 5.
    assert SMOLLM2 == 737_280
    assert sizes(KVBudget(GIB), SMOLLM2, SMOLLM2) == 728


@pytest.mark.parametrize("budget, target, draft, expected", [
    (KVBudget(GIB), SMOLLM2, TINY_DRAFT, 1424),  # a draft of 1/45 the bytes takes 1/46 of the budget
    (KVBudget(4 * GIB), SMOLLM2, SMOLLM2, 2912),
    (KVBudget(64 * GIB, 0.9, 80 * GIB), block_bytes(32, 8, 128, 2), block_bytes(16, 8, 64, 2), 26214),
])
def test_the_pools_share_the_budget_in_proportion_to_their_bytes(budget, target, draft, expected):
    assert sizes(budget, target, draft) == expected == budget.num_bytes // (target + draft)
    assert expected * (target + draft) <= budget.num_bytes < (expected + 1) * (target + draft)


def test_the_draft_pool_holds_at_most_max_num_seqs_requests():
    # 8 requests of 8,192 + 5 tokens: 513 blocks each, whatever is left of 64 GiB.
    assert sizes(KVBudget(64 * GIB, 0.9, 80 * GIB), SMOLLM2, SMOLLM2, max_num_seqs=8) == 8 * 513


def test_a_cpu_budget_too_small_names_the_max_model_len_that_fits():
    with pytest.raises(ValueError) as refused:
        sizes(KVBudget(256 << 20), SMOLLM2, SMOLLM2)  # 182 blocks each: 2,912 tokens
    assert str(refused.value) == (
        "the KV caches of the model and of its draft model hold 2912 tokens (182 blocks of 16), and one request "
        "of max_model_len=8192 needs 8197 (with its 5 speculative tokens); it fits with max_model_len=2907 or less")


def test_a_gpu_budget_too_small_names_both_settings_as_flags():
    with pytest.raises(ValueError) as refused:
        sizes(KVBudget(GIB // 4, 0.5, 40 * GIB), SMOLLM2, SMOLLM2, spell=FLAGS)
    # 513 blocks of 1,474,560 bytes is 0.7045 GiB more than the pools' 0.25: 0.5 + 0.4545 / 40 -> 0.52.
    assert str(refused.value) == (
        "the KV caches of the model and of its draft model hold 2912 tokens (182 blocks of 16), and one request "
        "of --max-model-len 8192 needs 8197 (with its 5 speculative tokens); it fits with --max-model-len 2907 "
        "or less or with --gpu-memory-utilization 0.52")


def test_a_given_block_count_too_small_names_the_override_that_fits():
    message = shortfall_message(300, None, block_bytes=2 * SMOLLM2, block_size=16, max_model_len=8192,
                                extra_tokens=5, spell=ARGUMENTS, pools="the KV cache of the draft model holds")
    assert message == ("the KV cache of the draft model holds 4800 tokens (300 blocks of 16), and one request of "
                       "max_model_len=8192 needs 8197 (with its 5 speculative tokens); it fits with "
                       "max_model_len=4795 or less or with num_gpu_blocks_override=513")


def test_a_budget_that_holds_nothing_says_so():
    with pytest.raises(ValueError, match="; no setting makes room for it on this device$"):
        sizes(KVBudget(0), SMOLLM2, SMOLLM2)


def test_a_configs_bytes_per_block_are_the_ones_pinned_here():
    smollm2 = SimpleNamespace(num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, hidden_size=576)
    assert kv_block_bytes(smollm2, 16, torch.float32) == SMOLLM2
