"""The mixture-of-experts routers against Hugging Face transformers' routers (Qwen3-MoE,
Mixtral, DeepSeek V2 and V3) on random logits, and against a per-token reference written from
DeepSeek's published routing for the cases transformers does not cover."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from spillway.worker.models.routers import GroupedTopK, GroupScore, Scoring, grouped_topk, softmax_topk

HIDDEN = 32
TOKENS = 64


def random_router(router: torch.nn.Module, seed: int) -> torch.nn.Module:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=generator))
    return router


def hidden_states(seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(seed)).to(dtype)


def by_expert_id(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's choices in expert-id order: routers may list the same choice in any order."""
    order = ids.argsort(dim=-1)
    return weights.gather(1, order), ids.gather(1, order)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_softmax_topk_equals_qwen3_moe_router(norm_topk_prob, dtype):
    config = transformers.Qwen3MoeConfig(hidden_size=HIDDEN, num_experts=16, num_experts_per_tok=4,
                                         norm_topk_prob=norm_topk_prob)
    router = random_router(Qwen3MoeTopKRouter(config), seed=0).to(dtype)
    hidden = hidden_states(seed=1, dtype=dtype)
    with torch.no_grad():
        logits, hf_weights, hf_ids = router(hidden)

    weights, ids = softmax_topk(logits, 4, renormalize=norm_topk_prob, weights_in_logits_dtype=True)

    assert weights.dtype == torch.float32 and weights.shape == (TOKENS, 4)
    assert torch.equal(ids, hf_ids)
    assert torch.equal(weights, hf_weights.float())
    if dtype == torch.bfloat16:  # the weights hold bfloat16 values, as Qwen3-MoE multiplies by
        assert torch.equal(weights, weights.bfloat16().float())
    if norm_topk_prob:
        assert torch.allclose(weights.sum(-1), torch.ones(TOKENS), atol=2e-2 if dtype == torch.bfloat16 else 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softmax_topk_equals_mixtral_router_in_float32(dtype):
    config = transformers.MixtralConfig(hidden_size=HIDDEN, num_local_experts=8, num_experts_per_tok=2)
    router = random_router(MixtralTopKRouter(config), seed=2).to(dtype)
    hidden = hidden_states(seed=3, dtype=dtype)
    with torch.no_grad():
        logits, hf_weights, hf_ids = router(hidden)

    weights, ids = softmax_topk(logits, 2, renormalize=True)

    assert hf_weights.dtype == torch.float32
    assert torch.equal(ids, hf_ids)
    assert torch.equal(weights, hf_weights)


V3 = GroupedTopK(Scoring.SIGMOID, GroupScore.TOP2_SUM, num_groups=4, topk_groups=2, renormalize=True,
                 routed_scaling_factor=2.5)


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_grouped_topk_equals_deepseek_v3_router(seed, renormalize):
    config = transformers.DeepseekV3Config(hidden_size=HIDDEN, n_routed_experts=16, num_experts_per_tok=4,
                                           n_group=4, topk_group=2, norm_topk_prob=renormalize,
                                           routed_scaling_factor=2.5)
    router = random_router(DeepseekV3TopkRouter(config), seed)
    generator = torch.Generator().manual_seed(100 + seed)
    with torch.no_grad():  # a bias as large as the scores' spread, so it changes choices
        router.e_score_correction_bias.copy_(torch.rand(16, generator=generator) * 0.5)
        logits, hf_weights, hf_ids = router(hidden_states(seed + 10))
    params = GroupedTopK(Scoring.SIGMOID, GroupScore.TOP2_SUM, num_groups=4, topk_groups=2,
                         renormalize=renormalize, routed_scaling_factor=2.5)

    weights, ids = grouped_topk(logits, 4, params, router.e_score_correction_bias)

    hf_weights, hf_ids = by_expert_id(hf_weights, hf_ids)
    weights, ids = by_expert_id(weights, ids)
    assert torch.equal(ids, hf_ids)
    assert torch.allclose(weights, hf_weights, rtol=1e-6, atol=0)
    _, unbiased_ids = by_expert_id(*grouped_topk(logits, 4, params))
    assert (unbiased_ids != ids).any(dim=-1).sum() > TOKENS // 4  # the bias changed many choices


@pytest.mark.parametrize(("topk_method", "num_groups", "topk_groups"),
                         [("group_limited_greedy", 4, 2), ("greedy", 1, 1)])
def test_grouped_topk_equals_deepseek_v2_router(topk_method, num_groups, topk_groups):
    config = transformers.DeepseekV2Config(hidden_size=HIDDEN, num_attention_heads=4, n_routed_experts=16,
                                           num_experts_per_tok=3, n_group=num_groups, topk_group=topk_groups,
                                           topk_method=topk_method, routed_scaling_factor=16.0)
    router = random_router(DeepseekV2TopkRouter(config), seed=5)
    with torch.no_grad():
        logits, hf_weights, hf_ids = router(hidden_states(seed=6))
    params = GroupedTopK(Scoring.SOFTMAX, GroupScore.MAX, num_groups=num_groups, topk_groups=topk_groups,
                         renormalize=False, routed_scaling_factor=16.0)

    weights, ids = by_expert_id(*grouped_topk(logits, 3, params))

    hf_weights, hf_ids = by_expert_id(hf_weights, hf_ids)
    assert torch.equal(ids, hf_ids)
    assert torch.equal(weights, hf_weights)


def per_token_reference(logits: torch.Tensor, top_k: int, params: GroupedTopK,
                        bias: torch.Tensor | None) -> tuple[list[list[int]], list[list[float]]]:
    """DeepSeek's routing one token at a time, on Python lists: rank the groups, keep the best,
    take the best experts inside them (biased scores), weigh by the unbiased scores."""
    all_ids, all_weights = [], []
    for row in logits.double():
        scores = (row.sigmoid() if params.scoring is Scoring.SIGMOID else row.softmax(-1)).tolist()
        offsets = [0.0] * len(scores) if bias is None else bias.tolist()
        choice = [s + offset for s, offset in zip(scores, offsets)]
        size = len(scores) // params.num_groups
        groups = [choice[g * size:(g + 1) * size] for g in range(params.num_groups)]
        rank = (lambda g: sum(sorted(g)[-2:])) if params.group_score is GroupScore.TOP2_SUM else max
        best_groups = sorted(range(params.num_groups), key=lambda g: rank(groups[g]), reverse=True)
        kept = [e for g in best_groups[:params.topk_groups] for e in range(g * size, (g + 1) * size)]
        ids = sorted(sorted(kept, key=lambda e: choice[e], reverse=True)[:top_k])
        weights = [scores[e] for e in ids]
        total = sum(weights) if params.renormalize else 1.0
        all_ids.append(ids)
        all_weights.append([w / total * params.routed_scaling_factor for w in weights])
    return all_ids, all_weights


@pytest.mark.parametrize("params", [
    V3,
    GroupedTopK(Scoring.SOFTMAX, GroupScore.MAX, num_groups=4, topk_groups=2, renormalize=True,
                routed_scaling_factor=1.0),
    GroupedTopK(Scoring.SOFTMAX, GroupScore.MAX, num_groups=8, topk_groups=3, renormalize=False,
                routed_scaling_factor=16.0),
    GroupedTopK(Scoring.SIGMOID, GroupScore.MAX, num_groups=2, topk_groups=1, renormalize=False,
                routed_scaling_factor=1.0),
], ids=["v3", "v2-renormalised", "v2-scaled", "sigmoid-max"])
def test_grouped_topk_equals_a_per_token_reference(params):
    generator = torch.Generator().manual_seed(7)
    logits = torch.randn(TOKENS, 16, generator=generator) * 2
    bias = torch.rand(16, generator=generator) * 0.3 if params.scoring is Scoring.SIGMOID else None

    weights, ids = by_expert_id(*grouped_topk(logits, 4, params, bias))

    expected_ids, expected_weights = per_token_reference(logits, 4, params, bias)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    assert ids.tolist() == expected_ids
    assert torch.allclose(weights.double(), torch.tensor(expected_weights, dtype=torch.float64), rtol=1e-5)


def test_the_correction_bias_chooses_the_experts_and_the_scores_weigh_them():
    """Two groups of two experts. Unbiased, group 0 wins (top-2 sums 1.5 + 1.0 against 0.5 +
    0.4); biased, expert 3's +3 makes group 1 win, and experts 3 and 2 are chosen."""
    scores = torch.tensor([[1.5, 1.0, 0.5, 0.4]])
    logits = torch.logit(torch.sigmoid(scores))  # sigmoid(logits) == sigmoid(scores)
    params = GroupedTopK(Scoring.SIGMOID, GroupScore.TOP2_SUM, num_groups=2, topk_groups=1, renormalize=False,
                         routed_scaling_factor=2.0)

    weights, ids = grouped_topk(logits, 2, params)
    assert ids.tolist() == [[0, 1]]
    biased_weights, biased_ids = grouped_topk(logits, 2, params, torch.tensor([0.0, 0.0, 0.0, 3.0]))

    assert biased_ids.tolist() == [[3, 2]]
    assert torch.allclose(biased_weights, 2.0 * torch.sigmoid(torch.tensor([[0.4, 0.5]])))
    assert torch.allclose(weights, 2.0 * torch.sigmoid(torch.tensor([[1.5, 1.0]])))


def test_groups_that_cannot_hold_top_k_experts_are_refused():
    params = GroupedTopK(Scoring.SOFTMAX, GroupScore.MAX, num_groups=4, topk_groups=1, renormalize=False,
                         routed_scaling_factor=1.0)
    with pytest.raises(ValueError, match="16 experts do not split into 4 groups of which 1 hold 5 experts"):
        grouped_topk(torch.zeros(2, 16), 5, params)
    with pytest.raises(ValueError, match="15 experts"):
        grouped_topk(torch.zeros(2, 15), 2, params)


@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize(("num_groups", "topk_groups"), [(1, 1), (4, 4)])
def test_grouping_that_keeps_every_group_of_softmax_scores_is_softmax_topk(num_groups, topk_groups, renormalize):
    """What lets the model route DeepSeek V2-Lite through the softmax router's kernel."""
    params = GroupedTopK(Scoring.SOFTMAX, GroupScore.MAX, num_groups=num_groups, topk_groups=topk_groups,
                         renormalize=renormalize, routed_scaling_factor=2.5)
    logits = torch.randn(64, 16, generator=torch.Generator().manual_seed(9))
    assert params.is_softmax_topk
    assert not GroupedTopK(Scoring.SIGMOID, GroupScore.MAX, num_groups, topk_groups, renormalize, 2.5).is_softmax_topk
    assert not GroupedTopK(Scoring.SOFTMAX, GroupScore.MAX, 4, 2, renormalize, 2.5).is_softmax_topk

    weights, ids = softmax_topk(logits, 3, renormalize=renormalize)

    expected_weights, expected_ids = by_expert_id(*grouped_topk(logits, 3, params))
    weights, ids = by_expert_id(weights * 2.5, ids)
    assert torch.equal(ids, expected_ids)
    assert torch.equal(weights, expected_weights)
