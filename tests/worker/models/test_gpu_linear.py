"""Input-major projection weights: same values and outputs, only the strides change."""

from __future__ import annotations

import pytest
import torch
import transformers

from spillway.worker.models.gpu_linear import store_weights_input_major
from spillway.worker.models.layers import TORCH_OPS
from spillway.worker.models.llama import LlamaForCausalLM


def _model(tie: bool) -> LlamaForCausalLM:
    config = transformers.Qwen3Config(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, tie_word_embeddings=tie,
    )
    model = LlamaForCausalLM.build(config, device=torch.device("cpu"), dtype=torch.float32, ops=TORCH_OPS)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    return model


@pytest.mark.parametrize("tie", [False, True])
def test_projections_become_input_major_and_compute_the_same(tie):
    model = _model(tie)
    before = {name: tensor.clone() for name, tensor in model.checkpoint_weights()}
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
    layer = model.model.layers[1]
    with torch.no_grad():
        expected = [layer.self_attn.qkv_proj(x), layer.mlp.gate_up_proj(x), model.lm_head(x)]

    assert store_weights_input_major(model) == 8  # qkv, o, gate_up, down in each of 2 layers
    for module in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        rows, cols = module.weight.shape
        assert module.weight.stride() == (1, rows) and module.weight.t().is_contiguous()
    assert model.lm_head.weight.is_contiguous() and model.model.embed_tokens.weight.is_contiguous()
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tie

    after = dict(model.checkpoint_weights())
    assert after.keys() == before.keys()
    for name, tensor in before.items():
        assert torch.equal(after[name], tensor), name
    with torch.no_grad():
        got = [layer.self_attn.qkv_proj(x), layer.mlp.gate_up_proj(x), model.lm_head(x)]
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)
    assert store_weights_input_major(model) == 0  # already input-major


def test_weights_load_into_input_major_storage():
    source, target = _model(False), _model(False)
    with torch.no_grad():
        for param in target.parameters():
            param.zero_()
    store_weights_input_major(target)
    target.load_weights(source.checkpoint_weights())
    for (name, want), (_, got) in zip(source.checkpoint_weights(), target.checkpoint_weights()):
        assert torch.equal(got, want), name
    assert target.model.layers[0].mlp.down_proj.weight.stride()[0] == 1
