"""The mixture-of-experts families read from their Hugging Face configs: which layers are
sparse (as transformers builds them), how wide and how many the experts are."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import transformers

from spillway.worker.models import model_class_for
from spillway.worker.models.llama import LlamaForCausalLM
from spillway.worker.models.spec import DecoderSpec, MoeSpec, RouterKind, model_type_of

_SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
              head_dim=8)


@pytest.mark.parametrize(("num_layers", "decoder_sparse_step", "mlp_only_layers"), [
    (4, 1, [1, 2]),
    (6, 2, [3]),
    (6, 3, []),
    (5, 2, [1, 3]),  # every layer the step makes sparse is dense again
])
def test_qwen3_moe_sparse_layers_are_those_transformers_builds(num_layers, decoder_sparse_step, mlp_only_layers):
    config = transformers.Qwen3MoeConfig(**_SMALL, num_hidden_layers=num_layers, num_experts=4,
                                         num_experts_per_tok=2, moe_intermediate_size=16,
                                         decoder_sparse_step=decoder_sparse_step, mlp_only_layers=mlp_only_layers)
    hf_sparse = tuple(i for i, layer in enumerate(transformers.Qwen3MoeForCausalLM(config).model.layers)
                      if hasattr(layer.mlp, "experts"))

    spec = DecoderSpec.from_config(config)

    if not hf_sparse:
        assert spec.moe is None
        return
    assert spec.moe.sparse_layers == hf_sparse
    assert [spec.moe.is_sparse(i) for i in range(num_layers)] == [i in hf_sparse for i in range(num_layers)]


def test_qwen3_moe_spec():
    config = transformers.Qwen3MoeConfig(**_SMALL, num_hidden_layers=2, num_experts=8, num_experts_per_tok=2,
                                         moe_intermediate_size=16, norm_topk_prob=True)
    spec = DecoderSpec.from_config(config)
    assert spec.moe == MoeSpec(num_experts=8, top_k=2, expert_intermediate_size=16, norm_topk_prob=True,
                               sparse_layers=(0, 1), router=RouterKind.SOFTMAX_TOPK, weights_in_logits_dtype=True)
    assert spec.qk_norm and spec.intermediate_size == 48 and spec.sliding_window is None


def test_mixtral_spec():
    config = transformers.MixtralConfig(**_SMALL, num_hidden_layers=3, num_local_experts=6, num_experts_per_tok=2,
                                        sliding_window=64)
    spec = DecoderSpec.from_config(config)
    assert spec.moe == MoeSpec(num_experts=6, top_k=2, expert_intermediate_size=48, norm_topk_prob=True,
                               sparse_layers=(0, 1, 2))
    assert not spec.qk_norm and spec.sliding_window == 64


def test_dense_families_have_no_moe_spec():
    assert DecoderSpec.from_config(transformers.Qwen3Config(**_SMALL, num_hidden_layers=1)).moe is None


def test_moe_families_are_chosen_by_model_type_or_architecture():
    assert model_class_for(transformers.Qwen3MoeConfig()) is LlamaForCausalLM
    assert model_class_for(transformers.MixtralConfig()) is LlamaForCausalLM
    assert model_type_of(SimpleNamespace(model_type="", architectures=["Qwen3MoeForCausalLM"])) == "qwen3_moe"
    assert model_type_of(SimpleNamespace(architectures=["MixtralForCausalLM"])) == "mixtral"
