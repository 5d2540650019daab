"""Store new keys and values in the paged KV cache.

The cache is `[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`; row i of k/v
goes to slot `slot_mapping[i] = block * block_size + offset`, i.e. to
`kv_cache[block, layer, 0 (k) / 1 (v), offset]` (a float8 cache keeps a block's values
transposed, kernels/fp8.py). A negative slot marks a padded row, which is skipped, so a CUDA
graph can run with a fixed number of rows.

The cache holds k/v's dtype, or float8 e4m3 for k/v of any float dtype: clamped to +-448 and
rounded, unscaled (kernels/fp8.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from spillway.kernels.fp8 import cache_values, to_cache_dtype, to_cache_dtype_reference, value_offset
from spillway.kernels.utils import (
    INDEX_DTYPES,
    KV_CACHE_DTYPES,
    check,
    check_tensor,
    dtypes_for_cache,
    for_device,
    next_power_of_2,
    wait_for_inputs,
)


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, cache_ptr, slot_ptr,
    stride_k_row, stride_k_head, stride_v_row, stride_v_head,
    stride_c_block, stride_c_kv, stride_c_token, stride_c_head,
    layer_offset,
    num_kv_heads, head_dim,
    BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, HAS_VALUES: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    row = tl.program_id(0)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    # A padded row (slot < 0) masks every head out.
    mask = (heads < tl.where(slot >= 0, num_kv_heads, 0)) & (dims < head_dim)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    block_base = cache_ptr + layer_offset + block * stride_c_block
    key = tl.load(k_ptr + row * stride_k_row + heads * stride_k_head + dims, mask=mask)
    tl.store(block_base + offset * stride_c_token + heads * stride_c_head + dims, to_cache_dtype(key, cache_ptr),
             mask=mask)
    if HAS_VALUES:
        value = tl.load(v_ptr + row * stride_v_row + heads * stride_v_head + dims, mask=mask)
        value_dst = block_base + stride_c_kv + value_offset(cache_ptr, offset, heads, dims, stride_c_token,
                                                            stride_c_head, BLOCK_SIZE)
        tl.store(value_dst, to_cache_dtype(value, cache_ptr), mask=mask)


def write_kv(
    k: torch.Tensor, v: torch.Tensor | None, kv_cache: torch.Tensor, layer: int, slot_mapping: torch.Tensor
) -> None:
    """Store `k`, `v` `[rows, num_kv_heads, head_dim]` of `layer` at `slot_mapping` `[rows]`, in place.

    Rows whose slot is negative are skipped. k/v may be strided views (e.g. slices of a fused
    qkv projection) as long as their last dim is contiguous. k/v have the cache's dtype, or
    any float dtype when the cache is float8 e4m3. A one-sided cache (an MLA model's latent
    rows, `kv_cache.shape[2] == 1`) takes `k` only, `v` None: its rows serve as both.
    """
    device = kv_cache.device
    check_tensor("kv_cache", kv_cache, ndim=6, dtypes=KV_CACHE_DTYPES, device=device)
    num_blocks, num_layers, sides, block_size, num_kv_heads, head_dim = kv_cache.shape
    check(sides == (1 if v is None else 2),
          f"kv_cache dim 2 must be {'1 (latent rows, no v)' if v is None else '2 (k, v)'}, "
          f"got shape {tuple(kv_cache.shape)}")
    check(kv_cache.is_contiguous(), "kv_cache must be contiguous")
    check(0 <= layer < num_layers, f"layer {layer} out of range for {num_layers} layers")
    for name, tensor in (("k", k), ("v", k if v is None else v)):
        check_tensor(name, tensor, ndim=3, dtypes=dtypes_for_cache(kv_cache.dtype), device=device)
        check(
            tuple(tensor.shape[1:]) == (num_kv_heads, head_dim),
            f"{name} must be [rows, {num_kv_heads}, {head_dim}], got {tuple(tensor.shape)}",
        )
    if v is not None:
        check(k.shape[0] == v.shape[0], f"k has {k.shape[0]} rows, v has {v.shape[0]}")
        check(k.dtype == v.dtype, f"k is {k.dtype}, v is {v.dtype}")
    check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=INDEX_DTYPES, device=device)
    num_slots = slot_mapping.shape[0]
    check(num_slots == k.shape[0], f"slot_mapping has {num_slots} slots for {k.shape[0]} rows")
    num_rows = k.shape[0]
    if num_rows == 0:
        return
    kernel = for_device(_write_kv_kernel, device)
    values = k if v is None else v  # not read without values
    kernel[(num_rows,)](
        k, values, kv_cache, slot_mapping,
        k.stride(0), k.stride(1), values.stride(0), values.stride(1),
        kv_cache.stride(0), kv_cache.stride(2), kv_cache.stride(3), kv_cache.stride(4),
        layer * kv_cache.stride(1),
        num_kv_heads, head_dim,
        BLOCK_SIZE=block_size, BLOCK_H=next_power_of_2(num_kv_heads), BLOCK_D=next_power_of_2(head_dim),
        HAS_VALUES=v is not None, num_warps=4 if num_kv_heads * head_dim >= 1024 else 1,
    )


def write_kv_reference(
    k: torch.Tensor, v: torch.Tensor | None, kv_cache: torch.Tensor, layer: int, slot_mapping: torch.Tensor
) -> None:
    """`write_kv` in plain torch: a float8 cache gets k/v clamped to +-448, then cast."""
    block_size = kv_cache.shape[3]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    blocks, offsets = torch.div(slots, block_size, rounding_mode="floor"), slots % block_size
    kv_cache[blocks, layer, 0, offsets] = to_cache_dtype_reference(k[keep], kv_cache.dtype)
    if v is not None:
        cache_values(kv_cache, layer)[blocks, offsets] = to_cache_dtype_reference(v[keep], kv_cache.dtype)
