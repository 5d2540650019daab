"""The dense gated MLP, `down(silu(gate(x)) * up(x))`, with gate and up fused into one
projection (`gate_up_proj`, rows `[gate | up]`): a decoder layer's feed-forward block, and a
mixture-of-experts layer's shared experts."""

from __future__ import annotations

import torch
from torch import nn

from spillway.worker.models.layers import DecoderOps


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, ops: DecoderOps) -> None:
        super().__init__()
        self.ops = ops
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(hidden)))
