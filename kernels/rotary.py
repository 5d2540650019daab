"""Rotary position embedding, NeoX / Hugging Face style (rotate halves), applied in place.

For each token t at position p and each head, with x = [x1 | x2] split at head_dim / 2:

    x1' = x1 * cos[p] - x2 * sin[p]
    x2' = x2 * cos[p] + x1 * sin[p]

`cos_cache` and `sin_cache` are float32 `[max_positions, head_dim // 2]`, built once by the
model's `RotaryEmbedding.reserve_positions` (worker/models/layers.py), which folds a scaling's
attention factor (YaRN's) into them; `build_cos_sin_cache` builds unscaled ones. The
rotation is computed in float32 and rounded once to q/k's dtype (layers.py rounds cos/sin
and each product to the model dtype first, so bf16 results may differ by an ulp).

`apply_rotary` overwrites q and k (which may be strided views into a fused qkv output)
and returns them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from spillway.kernels.utils import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check,
    check_tensor,
    for_device,
    next_power_of_2,
    wait_for_inputs,
)


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, positions_ptr, cos_ptr, sin_ptr,
    stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_cache,
    num_q_heads, num_kv_heads,
    HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    cols = tl.arange(0, HALF)
    cos = tl.load(cos_ptr + position * stride_cache + cols)[None, :]
    sin = tl.load(sin_ptr + position * stride_cache + cols)[None, :]

    q_heads = tl.arange(0, BLOCK_HQ)[:, None]
    q_mask = q_heads < num_q_heads
    q1_ptrs = q_ptr + token * stride_q_t + q_heads * stride_q_h + cols[None, :]
    q1 = tl.load(q1_ptrs, mask=q_mask, other=0.0).to(tl.float32)
    q2 = tl.load(q1_ptrs + HALF, mask=q_mask, other=0.0).to(tl.float32)
    tl.store(q1_ptrs, (q1 * cos - q2 * sin).to(q_ptr.dtype.element_ty), mask=q_mask)
    tl.store(q1_ptrs + HALF, (q2 * cos + q1 * sin).to(q_ptr.dtype.element_ty), mask=q_mask)

    k_heads = tl.arange(0, BLOCK_HK)[:, None]
    k_mask = k_heads < num_kv_heads
    k1_ptrs = k_ptr + token * stride_k_t + k_heads * stride_k_h + cols[None, :]
    k1 = tl.load(k1_ptrs, mask=k_mask, other=0.0).to(tl.float32)
    k2 = tl.load(k1_ptrs + HALF, mask=k_mask, other=0.0).to(tl.float32)
    tl.store(k1_ptrs, (k1 * cos - k2 * sin).to(k_ptr.dtype.element_ty), mask=k_mask)
    tl.store(k1_ptrs + HALF, (k2 * cos + k1 * sin).to(k_ptr.dtype.element_ty), mask=k_mask)


def build_cos_sin_cache(
    inv_freq: torch.Tensor, max_positions: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 `(cos, sin)`, each `[max_positions, head_dim // 2]`, angles as layers.py computes them."""
    positions = torch.arange(max_positions, device=device)
    angles = positions.float()[:, None] * inv_freq.to(device=device, dtype=torch.float32)[None, :]
    return angles.cos().contiguous(), angles.sin().contiguous()


def apply_rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q `[T, q_heads, D]` and k `[T, kv_heads, D]` in place by `positions` `[T]`; returns (q, k).

    Positions must be below `cos_cache.shape[0]` (not checked on the device).
    """
    device = q.device
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES, device=device)
    check_tensor("k", k, ndim=3, dtypes=(q.dtype,), device=device)
    num_tokens, num_q_heads, head_dim = q.shape
    check(k.shape[0] == num_tokens and k.shape[2] == head_dim,
          f"k {tuple(k.shape)} must be [{num_tokens}, kv_heads, {head_dim}]")
    check(head_dim % 2 == 0 and next_power_of_2(head_dim) == head_dim,
          f"head_dim must be an even power of two, got {head_dim}")
    check_tensor("positions", positions, ndim=1, dtypes=INDEX_DTYPES, device=device)
    check(positions.shape[0] == num_tokens,
          f"positions has {positions.shape[0]} entries for {num_tokens} tokens")
    check(positions.is_contiguous(), "positions must be contiguous")
    for name, cache in (("cos_cache", cos_cache), ("sin_cache", sin_cache)):
        check_tensor(name, cache, ndim=2, dtypes=(torch.float32,), device=device)
        check(cache.shape[1] == head_dim // 2,
              f"{name} must be [max_positions, {head_dim // 2}], got {tuple(cache.shape)}")
    check(cos_cache.stride() == sin_cache.stride(), "cos_cache and sin_cache need the same strides")
    if num_tokens == 0:
        return q, k
    for_device(_rotary_kernel, device)[(num_tokens,)](
        q, k, positions, cos_cache, sin_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_cache.stride(0),
        num_q_heads, k.shape[1],
        HALF=head_dim // 2, BLOCK_HQ=next_power_of_2(num_q_heads), BLOCK_HK=next_power_of_2(k.shape[1]),
        num_warps=4,
    )
    return q, k


def apply_rotary_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """New rotated (q, k), computed in float32 and rounded once."""
    cos = cos_cache[positions][:, None, :]
    sin = sin_cache[positions][:, None, :]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    return rotate(q), rotate(k)
