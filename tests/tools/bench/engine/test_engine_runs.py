"""tools/bench/engine/engine_runs.py's decode floor, `weight_bytes_per_token`, on tiny models
built on the meta device: every weight but an untied embedding table, and of each expert
tensor only the share of the experts one token is routed to."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(ROOT))

from spillway.tools.bench.engine.engine_runs import weight_bytes_per_token  # noqa: E402
from spillway.worker.models import build_model  # noqa: E402
from tests.worker.tiny_models import tiny_mixtral, tiny_qwen3_moe  # noqa: E402

HIDDEN, VOCAB = 64, 384
BF16_BYTES = 2


def meta_model(config) -> torch.nn.Module:
    return build_model(config, device=torch.device("meta"), dtype=torch.bfloat16)


def all_weight_bytes(model) -> int:
    return sum(param.numel() * BF16_BYTES for param in model.parameters())


@pytest.mark.parametrize("tied", [False, True])
def test_a_dense_model_reads_every_weight_but_an_untied_embedding(tied):
    from transformers import Qwen3Config

    config = Qwen3Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=tied)
    model = meta_model(config)
    embedding = VOCAB * HIDDEN * BF16_BYTES
    # Per layer: q, k, v, o; q and k norms; two layer norms; gate, up, down. Then the final norm and lm_head.
    layer = 64 * 64 + 2 * (32 * 64) + 64 * 64 + 2 * 16 + 2 * 64 + 3 * (128 * 64)
    read_per_token = (2 * layer + 64 + VOCAB * HIDDEN) * BF16_BYTES
    assert all_weight_bytes(model) == read_per_token + (0 if tied else embedding)

    assert weight_bytes_per_token(model) == read_per_token


@pytest.mark.parametrize("family, num_experts, top_k, expert_width, sparse_layers", [
    ("qwen3_moe", 6, 2, 32, 2),  # layer 1 of 3 has a dense MLP
    ("mixtral", 4, 2, 48, 2),
])
def test_a_mixture_of_experts_reads_only_the_chosen_share_of_each_expert_tensor(family, num_experts, top_k,
                                                                               expert_width, sparse_layers):
    config = {"qwen3_moe": tiny_qwen3_moe, "mixtral": tiny_mixtral}[family]().config
    model = meta_model(config)
    every_expert = sparse_layers * num_experts * 3 * HIDDEN * expert_width * BF16_BYTES  # gate, up, down
    experts_not_chosen = every_expert * (num_experts - top_k) // num_experts

    assert weight_bytes_per_token(model) == all_weight_bytes(model) - VOCAB * HIDDEN * BF16_BYTES - experts_not_chosen


@pytest.mark.parametrize("family, num_experts, top_k, expert_width, sparse_layers", [
    ("qwen3_moe", 6, 2, 32, 2),
    ("mixtral", 4, 2, 48, 2),
])
def test_the_step_profile_counts_the_routers_and_the_chosen_share_of_the_experts(family, num_experts, top_k,
                                                                                 expert_width, sparse_layers):
    from spillway.tools.bench.engine.step_profile import active_expert_params

    config = {"qwen3_moe": tiny_qwen3_moe, "mixtral": tiny_mixtral}[family]().config
    routers = sparse_layers * num_experts * HIDDEN
    chosen_experts = sparse_layers * top_k * 3 * HIDDEN * expert_width

    assert active_expert_params(meta_model(config)) == routers + chosen_experts


def test_the_step_profile_counts_no_experts_in_a_dense_model():
    from transformers import Qwen3Config

    from spillway.tools.bench.engine.step_profile import active_expert_params

    config = Qwen3Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    assert active_expert_params(meta_model(config)) == 0


def test_fp8_experts_count_a_byte_a_weight_and_their_share_of_the_row_scales():
    from spillway.worker.models.fp8_experts import quantize_experts

    model = meta_model(tiny_qwen3_moe().config)  # 2 sparse layers of 6 experts of width 32, top 2
    unquantized = weight_bytes_per_token(model)
    assert quantize_experts(model) == 2
    chosen_weights = 2 * 2 * 3 * HIDDEN * 32  # layers x top_k x (gate, up, down) x H x I
    chosen_scales = 2 * 2 * (2 * 32 + HIDDEN) * 4  # a float32 scale per gate, up and down row
    assert weight_bytes_per_token(model) == unquantized - chosen_weights * (BF16_BYTES - 1) + chosen_scales
