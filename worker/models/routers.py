"""Routers of the mixture-of-experts layers: which `top_k` experts each token goes to, and with
what weight. Pure functions of the router logits `[tokens, num_experts]`, each returning
`(topk_weights, topk_ids)`: float32 `[tokens, top_k]` and int64 `[tokens, top_k]`.

    softmax_topk   Mixtral, Qwen3-MoE: softmax over all experts, the top k, optionally
                   renormalised to sum 1 (Mixtral always, Qwen3-MoE by `norm_topk_prob`)
    grouped_topk   DeepSeek V2/V3: experts in groups; the best groups first, then the best
                   experts inside them; a correction bias may choose while the scores weigh

The arithmetic is Hugging Face transformers' (float32 softmax, division by the sum of the
chosen scores), so routing ties break as there and the weights are equal to rounding.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch


def softmax_topk(
    router_logits: torch.Tensor, top_k: int, *, renormalize: bool, weights_in_logits_dtype: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """The `top_k` experts of highest softmax probability, with those probabilities.

    `renormalize`: divide the chosen probabilities by their sum. `weights_in_logits_dtype`:
    round the weights through the logits' dtype, as Qwen3-MoE does before multiplying its
    experts' outputs (Mixtral multiplies by the float32 weights). They are returned in float32
    either way: a float32 weight holding a bfloat16 value times a bfloat16 output rounds to the
    same bfloat16 product.
    """
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    if weights_in_logits_dtype:
        topk_weights = topk_weights.to(router_logits.dtype).float()
    return topk_weights, topk_ids


class Scoring(str, Enum):
    """How logits become expert scores: DeepSeek V3's sigmoid, V2's softmax."""

    SIGMOID = "sigmoid"
    SOFTMAX = "softmax"


class GroupScore(str, Enum):
    """What ranks a group of experts: the sum of its top 2 scores (V3's "noaux_tc"), or its
    best score (V2's "group_limited_greedy")."""

    TOP2_SUM = "top2_sum"
    MAX = "max"


@dataclass(frozen=True, slots=True)
class GroupedTopK:
    """DeepSeek's routing parameters, read from its config.

    `num_groups` groups of consecutive experts; a token may use experts of `topk_groups` of
    them. `renormalize` (`norm_topk_prob`) divides the chosen scores by their sum (plus 1e-20),
    then `routed_scaling_factor` multiplies them, as DeepSeek V3 does. (DeepSeek V2's own code
    scales only where it does not renormalise: its released configs never do both, so a V2
    config's factor is read as 1 where it renormalises.)
    """

    scoring: Scoring
    group_score: GroupScore
    num_groups: int
    topk_groups: int
    renormalize: bool
    routed_scaling_factor: float

    @property
    def is_softmax_topk(self) -> bool:
        """Softmax scores with every group kept (DeepSeek V2-Lite's "greedy"): plain softmax
        top-k, which a GPU runs as one kernel (`DecoderOps.softmax_topk`), then the scaling."""
        return self.scoring is Scoring.SOFTMAX and self.topk_groups == self.num_groups


def grouped_topk(
    router_logits: torch.Tensor, top_k: int, params: GroupedTopK, correction_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's routing: score every expert (`params.scoring`, in float32), rank the groups by
    `params.group_score`, keep the best `params.topk_groups` groups, then the best `top_k`
    experts among theirs. `correction_bias` `[num_experts]` (V3's `e_score_correction_bias`)
    is added to the scores for choosing groups and experts only: the weights are the unbiased
    scores of the chosen experts, then renormalised and scaled (see `GroupedTopK`).
    """
    num_tokens, num_experts = router_logits.shape
    experts_per_group = num_experts // params.num_groups
    if experts_per_group * params.num_groups != num_experts or top_k > params.topk_groups * experts_per_group:
        raise ValueError(f"{num_experts} experts do not split into {params.num_groups} groups of which "
                         f"{params.topk_groups} hold {top_k} experts")
    logits = router_logits.float()
    scores = logits.sigmoid() if params.scoring is Scoring.SIGMOID else logits.softmax(dim=-1)
    for_choice = scores if correction_bias is None else scores + correction_bias.float()
    grouped = for_choice.view(num_tokens, params.num_groups, experts_per_group)
    if params.group_score is GroupScore.TOP2_SUM:
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
    else:
        group_scores = grouped.amax(dim=-1)
    kept_groups = torch.topk(group_scores, params.topk_groups, dim=-1, sorted=False).indices
    group_kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept_groups, True)
    expert_kept = group_kept.repeat_interleave(experts_per_group, dim=1)
    # -inf, not 0: biased sigmoid scores may be negative, and must still lose to a kept expert.
    topk_ids = torch.topk(for_choice.masked_fill(~expert_kept, float("-inf")), top_k, dim=-1).indices
    topk_weights = scores.gather(1, topk_ids)
    if params.renormalize:
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    return topk_weights * params.routed_scaling_factor, topk_ids
