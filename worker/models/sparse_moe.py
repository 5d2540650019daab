"""A mixture-of-experts layer, in place of a decoder layer's dense MLP:

    gate             the router: logits `hidden @ weight.T` `[tokens, E]`, then its routing
                       (worker/models/routers.py) → topk_weights, topk_ids `[tokens, K]`
    experts          every expert's weights stacked: gate_up_proj `[E, 2I, H]` (each expert's
                       `[gate | up]` rows), down_proj `[E, H, I]`; run by `ops.fused_experts`
    shared_experts   optional dense MLP that every token also goes through (DeepSeek), summed in

The parameters carry transformers 5's names; checkpoints list each expert's projections
apart (checkpoint_names.py). With FP8 weights, fp8_experts.py's `Fp8Experts` takes the place of
`Experts` once the weights are loaded: the same stacks in float8 e4m3fn with a scale per row.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from spillway.worker.models.layers import DecoderOps
from spillway.worker.models.mlp import MLP
from spillway.worker.models.routers import grouped_topk
from spillway.worker.models.spec import MoeSpec, RouterKind


class Router(nn.Module):
    """Chooses each token's `top_k` experts and their weights (float32 `[tokens, K]`): the softmax
    router through `ops.softmax_topk` (one kernel on a GPU), DeepSeek's in plain torch unless
    its grouping keeps every group of softmax scores without a bias (`is_softmax_topk`)."""

    def __init__(self, hidden_size: int, moe: MoeSpec, ops: DecoderOps) -> None:
        super().__init__()
        self.moe = moe
        self.ops = ops
        self.weight = nn.Parameter(torch.empty(moe.num_experts, hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.empty(moe.num_experts)) if moe.correction_bias else None

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        moe = self.moe
        if moe.router is RouterKind.GROUPED_TOPK:
            # DeepSeek computes its router logits in float32, whatever the model's dtype.
            logits = F.linear(hidden.float(), self.weight.float())
            params = moe.grouped_topk
            if params.is_softmax_topk and self.e_score_correction_bias is None:
                # grouped_topk's renormalising epsilon (1e-20) is below float32's resolution
                # of a sum of probabilities: the same weights.
                weights, ids = self.ops.softmax_topk(logits, moe.top_k, renormalize=params.renormalize)
                return weights * params.routed_scaling_factor, ids
            return grouped_topk(logits, moe.top_k, params, self.e_score_correction_bias)
        logits = F.linear(hidden, self.weight)
        return self.ops.softmax_topk(logits, moe.top_k, renormalize=moe.norm_topk_prob,
                                     weights_in_logits_dtype=moe.weights_in_logits_dtype)


class Experts(nn.Module):
    """Every expert's gated MLP, stacked; each token's output is its experts' weighted sum."""

    def __init__(self, hidden_size: int, moe: MoeSpec, ops: DecoderOps) -> None:
        super().__init__()
        self.ops = ops
        width = moe.expert_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(moe.num_experts, 2 * width, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(moe.num_experts, hidden_size, width))

    def forward(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        return self.ops.fused_experts(hidden, self.gate_up_proj, self.down_proj, topk_weights, topk_ids)


class SparseMoeBlock(nn.Module):
    def __init__(self, hidden_size: int, moe: MoeSpec, ops: DecoderOps) -> None:
        super().__init__()
        self.gate = Router(hidden_size, moe, ops)
        self.experts = Experts(hidden_size, moe, ops)
        shared_size = moe.shared_expert_intermediate_size
        self.shared_experts = None if shared_size is None else MLP(hidden_size, shared_size, bias=False, ops=ops)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = self.gate(hidden)
        out = self.experts(hidden, topk_weights, topk_ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(hidden)
        return out
