"""The mixture-of-experts block against transformers' blocks on the same weights: Qwen3-MoE's
and Mixtral's (bit for bit, in bfloat16 too), DeepSeek V3's and V2's (grouped routers, a
correction bias, shared experts)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Moe
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from spillway.worker.models.layers import TORCH_OPS
from spillway.worker.models.routers import GroupedTopK, GroupScore, Scoring
from spillway.worker.models.sparse_moe import SparseMoeBlock
from spillway.worker.models.spec import MoeSpec, RouterKind

HIDDEN = 32
WIDTH = 24
TOKENS = 40


def randomized(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            tensor.copy_(torch.randn(tensor.shape, generator=generator) * 0.3)
    return module.eval()


def our_block(moe: MoeSpec, hf_block: torch.nn.Module, dtype: torch.dtype) -> SparseMoeBlock:
    """Ours with the weights of `hf_block` (transformers 5's names are ours, but for the shared
    experts' separate gate and up projections)."""
    block = SparseMoeBlock(HIDDEN, moe, TORCH_OPS).to(dtype)
    state = {**dict(hf_block.named_parameters()), **dict(hf_block.named_buffers())}
    if moe.shared_expert_intermediate_size is not None:
        gate, up = state.pop("shared_experts.gate_proj.weight"), state.pop("shared_experts.up_proj.weight")
        state["shared_experts.gate_up_proj.weight"] = torch.cat([gate, up])
    missing, unexpected = block.load_state_dict(state, strict=False)
    assert not unexpected and not missing, (missing, unexpected)
    return block.eval()


def hidden_states(dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(9)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_moe-unnormalised", "mixtral"])
def test_softmax_routed_block_equals_transformers_bit_for_bit(family, dtype):
    if family == "mixtral":
        config = transformers.MixtralConfig(hidden_size=HIDDEN, intermediate_size=WIDTH, num_local_experts=6,
                                            num_experts_per_tok=2)
        hf_block = randomized(MixtralSparseMoeBlock(config), seed=1).to(dtype)
        moe = MoeSpec(num_experts=6, top_k=2, expert_intermediate_size=WIDTH, norm_topk_prob=True,
                      sparse_layers=(0,))
    else:
        norm = family == "qwen3_moe"
        config = transformers.Qwen3MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=WIDTH, num_experts=8,
                                             num_experts_per_tok=3, norm_topk_prob=norm)
        hf_block = randomized(Qwen3MoeSparseMoeBlock(config), seed=2).to(dtype)
        moe = MoeSpec(num_experts=8, top_k=3, expert_intermediate_size=WIDTH, norm_topk_prob=norm,
                      sparse_layers=(0,), weights_in_logits_dtype=True)
    hidden = hidden_states(dtype)
    with torch.no_grad():
        expected = hf_block(hidden[None])[0]
        got = our_block(moe, hf_block, dtype)(hidden)

    assert got.dtype == dtype
    assert torch.equal(got, expected)


def deepseek_config(config_class, **routing):
    return config_class(hidden_size=HIDDEN, num_attention_heads=4, moe_intermediate_size=WIDTH, n_routed_experts=16,
                        num_experts_per_tok=4, n_shared_experts=2, n_group=4, topk_group=2, **routing)


def test_grouped_block_with_bias_and_shared_experts_equals_deepseek_v3():
    config = deepseek_config(transformers.DeepseekV3Config, norm_topk_prob=True, routed_scaling_factor=2.5)
    hf_block = randomized(DeepseekV3MoE(config), seed=3)
    routing = GroupedTopK(Scoring.SIGMOID, GroupScore.TOP2_SUM, num_groups=4, topk_groups=2, renormalize=True,
                          routed_scaling_factor=2.5)
    moe = MoeSpec(num_experts=16, top_k=4, expert_intermediate_size=WIDTH, norm_topk_prob=True, sparse_layers=(0,),
                  router=RouterKind.GROUPED_TOPK, grouped_topk=routing, correction_bias=True,
                  shared_expert_intermediate_size=2 * WIDTH)
    block = our_block(moe, hf_block, torch.float32)
    hidden = hidden_states(torch.float32)
    with torch.no_grad():
        expected = hf_block(hidden[None])[0]
        got = block(hidden)
        without_shared = block.experts(hidden, *block.gate(hidden))

    assert torch.allclose(got, expected, rtol=0, atol=1e-5)
    # The shared experts are summed in: what is left is the dense MLP of every token.
    assert torch.allclose(got - without_shared, block.shared_experts(hidden), atol=1e-5)
    assert (got - without_shared).abs().max() > 0.1


def test_grouped_softmax_block_with_shared_experts_equals_deepseek_v2():
    config = deepseek_config(transformers.DeepseekV2Config, topk_method="group_limited_greedy",
                             routed_scaling_factor=16.0)
    hf_block = randomized(DeepseekV2Moe(config), seed=4)
    routing = GroupedTopK(Scoring.SOFTMAX, GroupScore.MAX, num_groups=4, topk_groups=2, renormalize=False,
                          routed_scaling_factor=16.0)
    moe = MoeSpec(num_experts=16, top_k=4, expert_intermediate_size=WIDTH, norm_topk_prob=False, sparse_layers=(0,),
                  router=RouterKind.GROUPED_TOPK, grouped_topk=routing, shared_expert_intermediate_size=2 * WIDTH)
    hidden = hidden_states(torch.float32)
    with torch.no_grad():
        expected = hf_block(hidden[None])[0]
        got = our_block(moe, hf_block, torch.float32)(hidden)

    assert torch.allclose(got, expected, rtol=0, atol=1e-4)


def test_the_block_hands_the_routed_choice_to_ops_fused_experts():
    """The experts run only through `ops.fused_experts` (the Triton kernel on CUDA)."""
    calls = []

    def fused_experts(hidden, w13, w2, topk_weights, topk_ids):
        calls.append((w13.shape, w2.shape, topk_weights.dtype, topk_ids.shape))
        return torch.zeros_like(hidden)

    ops = dataclasses.replace(TORCH_OPS, fused_experts=fused_experts)
    moe = MoeSpec(num_experts=4, top_k=2, expert_intermediate_size=WIDTH, norm_topk_prob=True, sparse_layers=(0,))
    block = randomized(SparseMoeBlock(HIDDEN, moe, ops), seed=5)
    with torch.no_grad():
        out = block(hidden_states(torch.float32))

    assert calls == [((4, 2 * WIDTH, HIDDEN), (4, HIDDEN, WIDTH), torch.float32, (TOKENS, 2))]
    assert torch.equal(out, torch.zeros(TOKENS, HIDDEN))
