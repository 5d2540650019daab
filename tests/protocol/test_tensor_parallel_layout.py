"""What the gateway refuses of a tensor-parallel size, from config.json's values alone."""

from __future__ import annotations

import json

from spillway.protocol.local.model_files import BUILTIN_CONFIGS_DIR
from spillway.protocol.tensor_parallel import layout_problems


def test_a_mixture_of_experts_splits_each_expert_s_width():
    config = json.loads((BUILTIN_CONFIGS_DIR / "qwen3-30b-a3b.json").read_text())  # 32 heads, 4 KV, experts 768 wide
    assert layout_problems(4, config) == []
    assert layout_problems(8, {**config, "moe_intermediate_size": 100}) == [
        "8 does not divide the model's experts' intermediate size 100"]
    assert layout_problems(3, config) == [
        "3 does not divide the model's 32 attention heads",
        "3 and the model's 4 KV heads do not divide one another (the KV heads are split across the ranks, or "
        "replicated when fewer)",
    ]


def test_a_dense_model_has_no_expert_width_to_split():
    config = json.loads((BUILTIN_CONFIGS_DIR / "qwen3-8b.json").read_text())
    assert layout_problems(2, config) == []
    assert "moe_intermediate_size" not in config


def test_an_mla_model_splits_its_query_heads_and_keeps_its_latent_whole():
    """DeepSeek's latent attention keeps one KV row a token, every rank's whole: only the query
    heads (and the MLP and experts' widths) must divide."""
    config = {"model_type": "deepseek_v3", "num_attention_heads": 128, "num_key_value_heads": 128,
              "intermediate_size": 18432, "moe_intermediate_size": 2048, "kv_lora_rank": 512}
    assert layout_problems(8, config) == []
    assert layout_problems(3, config) == ["3 does not divide the model's 128 attention heads",
                                          "3 does not divide the model's experts' intermediate size 2048"]
