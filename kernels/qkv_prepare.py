"""Everything between the fused qkv projection and attention, in one launch.

A decoder layer's qkv projection yields rows `[T, (num_heads + 2 * num_kv_heads) * head_dim]`:

    | q head 0 | ... | q head H-1 | k head 0 | ... | k head K-1 | v head 0 | ... | v head K-1 |

For each row t (one program per row, all of its heads as 2D tiles):

    q heads: RMSNorm (optional, Qwen3), then rotary at positions[t]   -> written back into qkv
    k heads: RMSNorm (optional), then rotary at positions[t]          -> written back into qkv
                                                                         and into the KV cache
    v heads: unchanged                                                -> into the KV cache

The arithmetic is that of the separate kernels run one after another (rmsnorm.py, rotary.py,
kv_write.py): normalise in float32 and round, scale by the weight and round, rotate in float32
and round. The cache is `[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`; row t
goes to slot `slot_mapping[t]` as in kv_write.py, and a negative slot (a padded row) writes
nothing there. The grid depends only on T, so the launch can be captured in a CUDA graph.

The cache holds qkv's dtype, or float8 e4m3: then the rotated k, rounded to qkv's dtype as
written back, and v are clamped to +-448 and rounded on their way in, unscaled (kernels/fp8.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from spillway.kernels.fp8 import FP8_E4M3, to_cache_dtype, value_offset
from spillway.kernels.kv_write import write_kv_reference
from spillway.kernels.utils import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check,
    check_cache,
    check_tensor,
    for_device,
    next_power_of_2,
    wait_for_inputs,
)


@triton.jit
def _norm_rotate(ptrs, mask, weight_ptr, cos, sin, eps, HALF: tl.constexpr, HAS_NORM: tl.constexpr):
    """Heads at `ptrs` (`[heads, HALF]`, first halves) normed and rotated: float32 (x1, x2)."""
    x1 = tl.load(ptrs, mask=mask, other=0.0)
    x2 = tl.load(ptrs + HALF, mask=mask, other=0.0)
    dtype = x1.dtype
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    if HAS_NORM:
        variance = (tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF)
        inv_rms = tl.math.rsqrt(variance + eps)[:, None]
        cols = tl.arange(0, HALF)[None, :]
        w1 = tl.load(weight_ptr + cols).to(tl.float32)
        w2 = tl.load(weight_ptr + HALF + cols).to(tl.float32)
        x1 = ((x1 * inv_rms).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
        x2 = ((x2 * inv_rms).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


@triton.jit
def _prepare_qkv_kernel(
    qkv_ptr, cache_ptr, slot_ptr, positions_ptr, cos_ptr, sin_ptr, q_weight_ptr, k_weight_ptr,
    stride_qkv_row, stride_cos,
    stride_c_block, stride_c_kv, stride_c_token, stride_c_head,
    layer_offset, num_heads, num_kv_heads, eps,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
    HAS_NORM: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    HALF: tl.constexpr = HEAD_DIM // 2
    row = tl.program_id(0).to(tl.int64)
    row_ptr = qkv_ptr + row * stride_qkv_row
    position = tl.load(positions_ptr + row).to(tl.int64)
    cols = tl.arange(0, HALF)[None, :]
    cos = tl.load(cos_ptr + position * stride_cos + cols)
    sin = tl.load(sin_ptr + position * stride_cos + cols)
    dtype = qkv_ptr.dtype.element_ty

    q_heads = tl.arange(0, BLOCK_HQ)[:, None]
    q_mask = q_heads < num_heads
    q_ptrs = row_ptr + q_heads * HEAD_DIM + cols
    q1, q2 = _norm_rotate(q_ptrs, q_mask, q_weight_ptr, cos, sin, eps, HALF, HAS_NORM)
    tl.store(q_ptrs, q1.to(dtype), mask=q_mask)
    tl.store(q_ptrs + HALF, q2.to(dtype), mask=q_mask)

    k_heads = tl.arange(0, BLOCK_HK)[:, None]
    k_mask = k_heads < num_kv_heads
    k_ptrs = row_ptr + (num_heads + k_heads) * HEAD_DIM + cols
    k1, k2 = _norm_rotate(k_ptrs, k_mask, k_weight_ptr, cos, sin, eps, HALF, HAS_NORM)
    k1 = k1.to(dtype)
    k2 = k2.to(dtype)
    tl.store(k_ptrs, k1, mask=k_mask)
    tl.store(k_ptrs + HALF, k2, mask=k_mask)

    slot = tl.load(slot_ptr + row).to(tl.int64)
    # A padded row (slot < 0) masks every head out of the cache writes.
    cache_mask = k_heads < tl.where(slot >= 0, num_kv_heads, 0)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    block_base = cache_ptr + layer_offset + block * stride_c_block
    dst = block_base + offset * stride_c_token + k_heads * stride_c_head
    tl.store(dst + cols, to_cache_dtype(k1, cache_ptr), mask=cache_mask)
    tl.store(dst + HALF + cols, to_cache_dtype(k2, cache_ptr), mask=cache_mask)
    dims = tl.arange(0, HEAD_DIM)[None, :]
    value = tl.load(row_ptr + (num_heads + num_kv_heads + k_heads) * HEAD_DIM + dims, mask=cache_mask)
    value_dst = block_base + stride_c_kv + value_offset(cache_ptr, offset, k_heads, dims, stride_c_token,
                                                        stride_c_head, BLOCK_SIZE)
    tl.store(value_dst, to_cache_dtype(value, cache_ptr), mask=cache_mask)


def _check_args(qkv, kv_cache, layer, slot_mapping, positions, cos_cache, sin_cache,
                num_heads, num_kv_heads, head_dim, q_norm_weight, k_norm_weight) -> None:
    device = qkv.device
    check_tensor("qkv", qkv, ndim=2, dtypes=FLOAT_DTYPES, device=device)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    check(qkv.shape[1] == width,
          f"qkv must be [rows, {width}] for {num_heads} q heads, {num_kv_heads} kv heads of {head_dim}, "
          f"got {tuple(qkv.shape)}")
    check_tensor("kv_cache", kv_cache, ndim=6, dtypes=(qkv.dtype, FP8_E4M3), device=device)
    check_cache(kv_cache, layer)
    check(tuple(kv_cache.shape[4:]) == (num_kv_heads, head_dim),
          f"kv_cache must hold {num_kv_heads} kv heads of {head_dim}, got shape {tuple(kv_cache.shape)}")
    num_rows = qkv.shape[0]
    for name, index in (("slot_mapping", slot_mapping), ("positions", positions)):
        check_tensor(name, index, ndim=1, dtypes=INDEX_DTYPES, device=device)
        check(index.shape[0] == num_rows, f"{name} has {index.shape[0]} entries for {num_rows} rows")
        check(index.is_contiguous(), f"{name} must be contiguous")
    for name, cache in (("cos_cache", cos_cache), ("sin_cache", sin_cache)):
        check_tensor(name, cache, ndim=2, dtypes=(torch.float32,), device=device)
        check(cache.shape[1] == head_dim // 2,
              f"{name} must be [max_positions, {head_dim // 2}], got {tuple(cache.shape)}")
    check(cos_cache.stride() == sin_cache.stride(), "cos_cache and sin_cache need the same strides")
    check((q_norm_weight is None) == (k_norm_weight is None), "pass both q and k norm weights or neither")
    for name, weight in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
        if weight is not None:
            check_tensor(name, weight, ndim=1, dtypes=(qkv.dtype,), device=device)
            check(weight.shape[0] == head_dim and weight.is_contiguous(),
                  f"{name} must be a contiguous [{head_dim}], got shape {tuple(weight.shape)}")


def prepare_qkv(
    qkv: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    slot_mapping: torch.Tensor,
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Norm (when weights are given) and rotate q and k of `qkv` in place, store k and v of
    `layer` at `slot_mapping`; returns q as a `[rows, num_heads, head_dim]` view of qkv.
    The cache has qkv's dtype, or float8 e4m3 (k and v are then clamped and rounded).

    Positions must be below `cos_cache.shape[0]` and slots inside the cache (neither is
    checked on the device). A padded row's q is processed too; only its cache write is skipped.
    """
    _check_args(qkv, kv_cache, layer, slot_mapping, positions, cos_cache, sin_cache,
                num_heads, num_kv_heads, head_dim, q_norm_weight, k_norm_weight)
    num_rows = qkv.shape[0]
    q = qkv[:, : num_heads * head_dim].view(num_rows, num_heads, head_dim)
    if num_rows == 0:
        return q
    has_norm = q_norm_weight is not None
    block_hq = next_power_of_2(num_heads)
    for_device(_prepare_qkv_kernel, qkv.device)[(num_rows,)](
        qkv, kv_cache, slot_mapping, positions, cos_cache, sin_cache,
        q_norm_weight if has_norm else cos_cache, k_norm_weight if has_norm else cos_cache,
        qkv.stride(0), cos_cache.stride(0),
        kv_cache.stride(0), kv_cache.stride(2), kv_cache.stride(3), kv_cache.stride(4),
        layer * kv_cache.stride(1), num_heads, num_kv_heads, eps,
        HEAD_DIM=head_dim, BLOCK_SIZE=kv_cache.shape[3], BLOCK_HQ=block_hq,
        BLOCK_HK=next_power_of_2(num_kv_heads), HAS_NORM=has_norm,
        num_warps=max(1, min(8, block_hq * head_dim // 512)),
    )
    return q


def prepare_qkv_reference(
    qkv: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    slot_mapping: torch.Tensor,
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """`prepare_qkv` in plain torch, with the same in-place effects on qkv and kv_cache."""
    num_rows, dtype = qkv.shape[0], qkv.dtype
    heads = qkv.view(num_rows, num_heads + 2 * num_kv_heads, head_dim)
    q, k, v = heads.split([num_heads, num_kv_heads, num_kv_heads], dim=1)
    cos = cos_cache[positions][:, None, :]
    sin = sin_cache[positions][:, None, :]

    def norm_rotate(x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        x = x.float()
        if weight is not None:
            normed = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
            x = (normed.float() * weight.float()).to(dtype).float()
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(dtype)

    q.copy_(norm_rotate(q, q_norm_weight))
    k.copy_(norm_rotate(k, k_norm_weight))
    write_kv_reference(k, v, kv_cache, layer, slot_mapping)
    return q
