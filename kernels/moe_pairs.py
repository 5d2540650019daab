"""The experts of a small batch: one program per token-expert pair and column tile, no sorting.

Two launches, each reading only the chosen experts' weights:

    gate/up: grid (M pairs, cdiv(I, BLOCK_SIZE_N))
             inter[p, j] = silu(x_t . w13[e, j]) * (x_t . w13[e, I + j])     t = p // K, e = ids[t, p % K]
    down:    grid (T tokens, cdiv(H, BLOCK_SIZE_N))
             out[t, n] = sum_k weights[t, k] * (inter[t K + k] . w2[ids[t, k], n])

Each product is a dot of one row with a tile of weight rows, summed in float32 (no tensor
cores: a batch this small is bound by reading the weights). The down program sums a token's
K choices itself, in order: no atomics, the same bits every run. The pair (and token) index
is the grid's fastest axis, so the programs that read one weight tile for several pairs of
the same expert run side by side and share it through L2.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from spillway.kernels.moe_config import MoeConfig
from spillway.kernels.utils import for_device, wait_for_inputs


@triton.jit
def _row_products(row_ptr, tile_ptr, second_offset, stride_tile, rows_ok, length,
                  BLOCK_SIZE_N: tl.constexpr, BLOCK_SIZE_K: tl.constexpr, EVEN_K: tl.constexpr,
                  SECOND: tl.constexpr):
    """float32 `[BLOCK_SIZE_N]`: the vector at row_ptr (`length` entries) dotted with each row
    tile_ptr + n * stride_tile where `rows_ok`, and with SECOND, also with the rows
    `second_offset` further on (the up rows), the vector loaded once."""
    ks = tl.arange(0, BLOCK_SIZE_K)
    tile_ptrs = tile_ptr + tl.arange(0, BLOCK_SIZE_N)[:, None] * stride_tile + ks[None, :]
    acc = tl.zeros([BLOCK_SIZE_N], dtype=tl.float32)
    second = tl.zeros([BLOCK_SIZE_N], dtype=tl.float32)
    for start in range(0, length, BLOCK_SIZE_K):
        if EVEN_K:
            vector = tl.load(row_ptr + start + ks)
            tile_mask = rows_ok[:, None]
        else:
            k_ok = start + ks < length
            vector = tl.load(row_ptr + start + ks, mask=k_ok, other=0.0)
            tile_mask = rows_ok[:, None] & k_ok[None, :]
        vector = vector.to(tl.float32)[None, :]
        acc += tl.sum(tl.load(tile_ptrs + start, mask=tile_mask, other=0.0).to(tl.float32) * vector, axis=1)
        if SECOND:
            tile = tl.load(tile_ptrs + second_offset + start, mask=tile_mask, other=0.0)
            second += tl.sum(tile.to(tl.float32) * vector, axis=1)
    return acc, second


@triton.jit
def _pair_gate_up_kernel(
    hidden_ptr, w13_ptr, ids_ptr, inter_ptr,
    top_k, hidden_size, intermediate,
    stride_h_t, stride_w_e, stride_w_n, stride_id_t, stride_id_k, stride_i_p,
    BLOCK_SIZE_N: tl.constexpr, BLOCK_SIZE_K: tl.constexpr, EVEN_K: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    pair = tl.program_id(0)
    token = pair // top_k
    expert = tl.load(ids_ptr + token * stride_id_t + (pair % top_k) * stride_id_k).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
    cols_ok = cols < intermediate
    row_ptr = hidden_ptr + token.to(tl.int64) * stride_h_t
    gate_ptr = w13_ptr + expert * stride_w_e + (tl.program_id(1) * BLOCK_SIZE_N).to(tl.int64) * stride_w_n
    gate, up = _row_products(row_ptr, gate_ptr, intermediate * stride_w_n, stride_w_n, cols_ok, hidden_size,
                             BLOCK_SIZE_N, BLOCK_SIZE_K, EVEN_K, True)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(inter_ptr + pair.to(tl.int64) * stride_i_p + cols, out.to(inter_ptr.dtype.element_ty), mask=cols_ok)


@triton.jit
def _pair_down_kernel(
    inter_ptr, w2_ptr, ids_ptr, weights_ptr, out_ptr,
    top_k, hidden_size, intermediate,
    stride_i_p, stride_w_e, stride_w_n, stride_id_t, stride_id_k, stride_wt_t, stride_wt_k, stride_o_t,
    BLOCK_SIZE_N: tl.constexpr, BLOCK_SIZE_K: tl.constexpr, EVEN_K: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    token = tl.program_id(0)
    first_col = tl.program_id(1) * BLOCK_SIZE_N
    cols = first_col + tl.arange(0, BLOCK_SIZE_N)
    cols_ok = cols < hidden_size
    acc = tl.zeros([BLOCK_SIZE_N], dtype=tl.float32)
    for choice in range(top_k):
        expert = tl.load(ids_ptr + token * stride_id_t + choice * stride_id_k).to(tl.int64)
        weight = tl.load(weights_ptr + token * stride_wt_t + choice * stride_wt_k).to(tl.float32)
        row_ptr = inter_ptr + (token * top_k + choice).to(tl.int64) * stride_i_p
        tile_ptr = w2_ptr + expert * stride_w_e + first_col.to(tl.int64) * stride_w_n
        product, _ = _row_products(row_ptr, tile_ptr, 0, stride_w_n, cols_ok, intermediate,
                                   BLOCK_SIZE_N, BLOCK_SIZE_K, EVEN_K, False)
        acc += weight * product
    tl.store(out_ptr + token.to(tl.int64) * stride_o_t + cols, acc.to(out_ptr.dtype.element_ty), mask=cols_ok)


def pair_experts(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                 topk_ids: torch.Tensor, config: MoeConfig) -> torch.Tensor:
    """The experts on arguments kernels/fused_moe.py's `fused_experts` has checked (T > 0)."""
    num_tokens, hidden_size = hidden.shape
    intermediate = w2.shape[2]
    top_k = topk_ids.shape[1]
    device = hidden.device
    block_n, block_k = config.block_size_n, config.block_size_k
    inter = torch.empty((num_tokens * top_k, intermediate), dtype=hidden.dtype, device=device)
    out = torch.empty((num_tokens, hidden_size), dtype=hidden.dtype, device=device)
    launch = dict(num_warps=config.num_warps, num_stages=config.num_stages)
    for_device(_pair_gate_up_kernel, device)[(num_tokens * top_k, triton.cdiv(intermediate, block_n))](
        hidden, w13, topk_ids, inter,
        top_k, hidden_size, intermediate,
        hidden.stride(0), w13.stride(0), w13.stride(1), topk_ids.stride(0), topk_ids.stride(1), inter.stride(0),
        BLOCK_SIZE_N=block_n, BLOCK_SIZE_K=block_k, EVEN_K=hidden_size % block_k == 0, **launch,
    )
    for_device(_pair_down_kernel, device)[(num_tokens, triton.cdiv(hidden_size, block_n))](
        inter, w2, topk_ids, topk_weights, out,
        top_k, hidden_size, intermediate,
        inter.stride(0), w2.stride(0), w2.stride(1), topk_ids.stride(0), topk_ids.stride(1),
        topk_weights.stride(0), topk_weights.stride(1), out.stride(0),
        BLOCK_SIZE_N=block_n, BLOCK_SIZE_K=block_k, EVEN_K=intermediate % block_k == 0, **launch,
    )
    return out
