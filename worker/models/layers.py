"""Decoder building blocks: plain-torch references and the switch to the Triton kernels.

The plain-torch functions are the references that the Triton kernels in `kernels/` are
checked against, so they follow Hugging Face's arithmetic exactly (RMSNorm in float32,
rotary angles in float32). A model calls them through a `DecoderOps`: `TORCH_OPS` on the
CPU, `kernel_ops()` on CUDA (fused residual add + norm; q/k norm, rotary and the KV store
in one kernel), so no CUDA path runs, and triton is not imported, on the CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from spillway.worker.models import routers
from spillway.worker.models.fp8_linear import dequantize_rows
from spillway.worker.models.rope_scaling import RopeScaling, default_inv_freq


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`weight * x / rms(x)` over the last dim, normalised in float32, scaled in x's dtype."""
    x_float = x.float()
    variance = x_float.pow(2).mean(-1, keepdim=True)
    return weight * (x_float * torch.rsqrt(variance + eps)).to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(rms_norm(residual + x), residual + x)`: the decoder's residual add, then its norm."""
    residual = residual + x
    return rms_norm(residual, weight, eps), residual


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` where the last dim of `gate_up` is `[gate | up]`."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def fused_experts(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """A mixture-of-experts layer's experts, summed: `sum_k w_k * expert_{id_k}(hidden)`.

    hidden `[tokens, H]`; w13 `[E, 2I, H]` (each expert's `[gate | up]` rows, Hugging Face's
    `gate_up_proj`); w2 `[E, H, I]` (`down_proj`); topk_weights `[tokens, K]` (float32 or
    hidden's dtype) and topk_ids `[tokens, K]` (any integer dtype). Returns `[tokens, H]` in
    hidden's dtype. Each expert runs once on the rows routed to it, in Hugging Face's order of
    operations (expert output times weight, accumulated in hidden's dtype), so float32 logits
    match transformers' to rounding. Only the experts chosen are read.

    FP8 experts (fp8_experts.py): w13 and w2 in float8 e4m3fn with one float32 scale per output
    row, w13_scale `[E, 2I]` and w2_scale `[E, H]`; each chosen expert's weights are dequantized
    to hidden's dtype as it runs, so the result is that of the dequantized experts.
    """
    out = torch.zeros_like(hidden)
    num_experts = w13.shape[0]
    flat_ids = topk_ids.reshape(-1).long()
    if flat_ids.numel() and (int(flat_ids.min()) < 0 or int(flat_ids.max()) >= num_experts):
        raise ValueError(f"expert ids must lie in [0, {num_experts}), got {flat_ids.min()}..{flat_ids.max()}")
    for expert in torch.unique(flat_ids).tolist():
        # Rows slot-major, as transformers gathers them: the products then match bit for bit.
        slot, token_idx = torch.where(topk_ids.t() == expert)
        gate_up_rows = _expert_rows(w13, w13_scale, expert, hidden.dtype)
        gate, up = F.linear(hidden[token_idx], gate_up_rows).chunk(2, dim=-1)
        expert_out = F.linear(F.silu(gate) * up, _expert_rows(w2, w2_scale, expert, hidden.dtype))
        expert_out = expert_out * topk_weights[token_idx, slot, None]
        out.index_add_(0, token_idx, expert_out.to(out.dtype))
    return out


def _expert_rows(weight: torch.Tensor, scale: torch.Tensor | None, expert: int, dtype: torch.dtype) -> torch.Tensor:
    """Expert `expert`'s weight rows as they multiply: as stored, or times their scales in float32
    (fp8 weights), then in `dtype`."""
    return weight[expert] if scale is None else dequantize_rows(weight[expert], scale[expert], dtype)


def rope_angles(rotary: RotaryEmbedding, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """A step's rotary inputs for `rotate_q_k`: `(cos, sin)`, once per step, not per layer."""
    return rotary.cos_sin(positions, dtype)


def rotate_q_k(
    q: torch.Tensor, k: torch.Tensor, rope: tuple[torch.Tensor, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """q `[tokens, heads, head_dim]` and k `[tokens, kv_heads, head_dim]` rotated per token."""
    cos, sin = rope
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


@dataclass(frozen=True, slots=True)
class DecoderOps:
    """The decoder's operations other than matrix products and attention.

    `TORCH_OPS` are the plain-torch references (the CPU path, exact to Hugging Face);
    `kernel_ops()` puts the Triton kernels of `spillway.kernels` in their place on CUDA.
    `rope_for_step` prepares, once per step, what every layer's `rotate_q_k` reads.

    `prepare_qkv`, when set, replaces q/k norm, `rotate_q_k` and the backend's KV store
    with one kernel over the fused qkv rows; the layer then calls `backend.attend`:

        prepare_qkv(qkv, rope, kv_cache, layer, slot_mapping,
                    num_heads, num_kv_heads, head_dim, q_norm, k_norm) -> q [rows, heads, head_dim]

    q_norm/k_norm are the layer's `RMSNorm`s, or None. The plain-torch path leaves it None,
    so it stays step for step the Hugging Face computation.

    `fused_experts(hidden, w13, w2, topk_weights, topk_ids, *, w13_scale=None, w2_scale=None)` is
    a mixture-of-experts layer's experts (see `fused_experts` below for the shapes; the scales go
    with fp8 weights); `softmax_topk` its softmax router's choice (worker/models/routers.py's
    contract).
    """

    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    add_rms_norm: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]]
    rope_for_step: Callable[[RotaryEmbedding, torch.Tensor, torch.dtype], tuple[torch.Tensor, ...]]
    rotate_q_k: Callable[[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]], tuple[torch.Tensor, torch.Tensor]]
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor]
    prepare_qkv: Callable[..., torch.Tensor] | None = None
    fused_experts: Callable[..., torch.Tensor] = fused_experts
    softmax_topk: Callable[..., tuple[torch.Tensor, torch.Tensor]] = routers.softmax_topk


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, ops: DecoderOps | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.ops = ops or TORCH_OPS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`(norm(residual + x), residual + x)`; the kernel may reuse x and residual's storage."""
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)


def rotary_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Inverse frequencies `[head_dim // 2]` in float32, on the CPU."""
    return default_inv_freq(head_dim, theta) if scaling is None else scaling.inv_freq(head_dim, theta)


class RotaryEmbedding:
    """Neox-style rotary embedding (rotate halves), angles computed per step from positions.

    Not an `nn.Module`: the frequencies are derived from the config, never loaded, so they
    survive building the model on the meta device. cos and sin carry the scaling's
    `attention_factor` (YaRN's; 1 otherwise, which leaves them bit for bit unchanged), both
    from `cos_sin` and in the tables the kernels read, as transformers multiplies them.
    """

    def __init__(self, head_dim: int, theta: float, scaling: RopeScaling | None) -> None:
        self.head_dim = head_dim
        self.inv_freq = rotary_inv_freq(head_dim, theta, scaling)
        self.attention_factor = 1.0 if scaling is None else scaling.attention_factor
        self.cos_cache: torch.Tensor | None = None  # float32 [positions, head_dim // 2], for the kernel
        self.sin_cache: torch.Tensor | None = None

    def to(self, device: torch.device) -> RotaryEmbedding:
        """Keep the frequencies on `device`, so a step never copies them (nor a CUDA graph)."""
        self.inv_freq = self.inv_freq.to(device)
        return self

    def reserve_positions(self, num_positions: int) -> None:
        """Tabulate cos/sin for positions `0 .. num_positions - 1` (kept if already as large)."""
        if self.cos_cache is not None and self.cos_cache.shape[0] >= num_positions:
            return
        positions = torch.arange(num_positions, device=self.inv_freq.device)
        angles = positions.float()[:, None] * self.inv_freq[None, :]
        self.cos_cache = angles.cos() * self.attention_factor
        self.sin_cache = angles.sin() * self.attention_factor

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """`cos, sin` of shape `[num_tokens, head_dim // 2]` for int positions `[num_tokens]`."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        angles = positions.float()[:, None] * self.inv_freq[None, :]
        cos, sin = angles.cos() * self.attention_factor, angles.sin() * self.attention_factor
        return cos.to(dtype), sin.to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` `[num_tokens, num_heads, head_dim]` by per-token angles `[num_tokens, head_dim // 2]`."""
    x1, x2 = x.chunk(2, dim=-1)
    cos = cos[:, None, :]
    sin = sin[:, None, :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


TORCH_OPS = DecoderOps(rms_norm, add_rms_norm, rope_angles, rotate_q_k, silu_and_mul)


def kernel_ops() -> DecoderOps:
    """The Triton kernels: residual add fused into the norm (in place); q/k norm, rotary from
    tabulated cos/sin (`RotaryEmbedding.reserve_positions` first) and the KV store fused; the
    experts of a mixture-of-experts layer in one fused kernel (kernels/fused_moe.py), its
    softmax router's top-k in another (kernels/moe_router.py)."""
    from spillway.kernels import activation, fused_moe, moe_router, qkv_prepare, rmsnorm, rotary

    def add_rms_norm_in_place(x, residual, weight, eps):
        return rmsnorm.fused_add_rms_norm(x, residual, weight, eps, inplace=True)

    def rope_positions(rotary_embedding: RotaryEmbedding, positions: torch.Tensor, dtype: torch.dtype):
        return positions, rotary_embedding.cos_cache, rotary_embedding.sin_cache

    def rotate_in_place(q, k, rope):
        return rotary.apply_rotary(q, k, *rope)

    def prepare_qkv(qkv, rope, kv_cache, layer, slot_mapping, num_heads, num_kv_heads, head_dim, q_norm, k_norm):
        norms = {} if q_norm is None else dict(q_norm_weight=q_norm.weight, k_norm_weight=k_norm.weight, eps=q_norm.eps)
        return qkv_prepare.prepare_qkv(qkv, kv_cache, layer, slot_mapping, *rope, num_heads, num_kv_heads, head_dim,
                                       **norms)

    return DecoderOps(rmsnorm.rms_norm, add_rms_norm_in_place, rope_positions, rotate_in_place,
                      activation.silu_and_mul, prepare_qkv, fused_experts=fused_moe.fused_experts,
                      softmax_topk=moe_router.softmax_topk)


def ops_for(device: torch.device) -> DecoderOps:
    """The Triton kernels on a CUDA device, the plain-torch references anywhere else."""
    if torch.device(device).type != "cuda":
        return TORCH_OPS
    return kernel_ops()
