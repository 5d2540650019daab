"""The experts of a small batch: one program per token-expert pair and column tile, no sorting.

Two launches, each reading only the chosen experts' weights:

    gate/up: grid (M pairs, cdiv(I, BLOCK_SIZE_N))
             inter[p, j] = silu(x_t . w13[e, j]) * (x_t . w13[e, I + j])     t = p // K, e = ids[t, p % K]
    down:    grid (T tokens, cdiv(H, BLOCK_SIZE_N))
             out[t, n] = sum_k weights[t, k] * (inter[t K + k] . w2[ids[t, k], n])

Each product is a dot of one row with a tile of weight rows, summed in float32 (no tensor
cores: a batch this small is bound by reading the weights). FP8 weight tiles are widened to
float32 like any other, and each sum times its weight row's scale once the loop is done. The
down program sums a token's K choices itself, their tiles loaded side by side and summed in
one fixed reduction: no atomics, the same bits every run. The pair (and token) index
is the grid's fastest axis, so the programs that read one weight tile for several pairs of
the same expert run side by side and share it through L2.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from spillway.kernels.moe_config import MoeConfig
from spillway.kernels.utils import for_device, next_power_of_2, stride_of, wait_for_inputs


@triton.jit
def _pair_gate_up_kernel(
    hidden_ptr, w13_ptr, scale_ptr, ids_ptr, inter_ptr,
    top_k, hidden_size, intermediate,
    stride_h_t, stride_w_e, stride_w_n, stride_s_e, stride_id_t, stride_id_k, stride_i_p,
    BLOCK_SIZE_N: tl.constexpr, BLOCK_SIZE_K: tl.constexpr, EVEN_K: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    pair = tl.program_id(0)
    token = pair // top_k
    expert = tl.load(ids_ptr + token * stride_id_t + (pair % top_k) * stride_id_k).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
    cols_ok = cols < intermediate
    ks = tl.arange(0, BLOCK_SIZE_K)
    row_ptrs = hidden_ptr + token.to(tl.int64) * stride_h_t + ks
    gate_ptrs = w13_ptr + expert * stride_w_e + cols.to(tl.int64)[:, None] * stride_w_n + ks[None, :]
    up_offset = intermediate * stride_w_n
    gate = tl.zeros([BLOCK_SIZE_N], dtype=tl.float32)
    up = tl.zeros([BLOCK_SIZE_N], dtype=tl.float32)
    for start in range(0, hidden_size, BLOCK_SIZE_K):
        if EVEN_K:
            row = tl.load(row_ptrs + start)
            tile_ok = cols_ok[:, None]
        else:
            k_ok = start + ks < hidden_size
            row = tl.load(row_ptrs + start, mask=k_ok, other=0.0)
            tile_ok = cols_ok[:, None] & k_ok[None, :]
        row = row.to(tl.float32)[None, :]
        gate += tl.sum(tl.load(gate_ptrs + start, mask=tile_ok, other=0.0).to(tl.float32) * row, axis=1)
        up += tl.sum(tl.load(gate_ptrs + up_offset + start, mask=tile_ok, other=0.0).to(tl.float32) * row, axis=1)
    if scale_ptr is not None:  # fp8 weights: a scale per row of w13, the gate rows' then the up rows'
        scale_ptrs = scale_ptr + expert * stride_s_e + cols
        gate *= tl.load(scale_ptrs, mask=cols_ok, other=0.0)
        up *= tl.load(scale_ptrs + intermediate, mask=cols_ok, other=0.0)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(inter_ptr + pair.to(tl.int64) * stride_i_p + cols, out.to(inter_ptr.dtype.element_ty), mask=cols_ok)


@triton.jit
def _pair_down_kernel(
    inter_ptr, w2_ptr, scale_ptr, ids_ptr, weights_ptr, out_ptr,
    top_k, hidden_size, intermediate,
    stride_i_p, stride_w_e, stride_w_n, stride_s_e, stride_id_t, stride_id_k, stride_wt_t, stride_wt_k, stride_o_t,
    CHOICES: tl.constexpr, BLOCK_SIZE_N: tl.constexpr, BLOCK_SIZE_K: tl.constexpr, EVEN_K: tl.constexpr,
    PDL: tl.constexpr,
):
    """Every choice's weight tile is loaded in one go ([CHOICES, BLOCK_SIZE_N, BLOCK_SIZE_K]): a
    token's K experts are read side by side, which keeps enough bytes in flight when the grid is
    only as wide as H over BLOCK_SIZE_N (one token)."""
    wait_for_inputs(PDL)
    token = tl.program_id(0)
    choices = tl.arange(0, CHOICES)
    choices_ok = choices < top_k
    experts = tl.load(ids_ptr + token * stride_id_t + choices * stride_id_k, mask=choices_ok, other=0).to(tl.int64)
    routing = tl.load(weights_ptr + token * stride_wt_t + choices * stride_wt_k, mask=choices_ok, other=0.0)
    cols = tl.program_id(1) * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
    cols_ok = cols < hidden_size
    ks = tl.arange(0, BLOCK_SIZE_K)
    row_ptrs = inter_ptr + (token * top_k + choices).to(tl.int64)[:, None] * stride_i_p + ks[None, :]
    tile_ptrs = (w2_ptr + experts[:, None, None] * stride_w_e + cols.to(tl.int64)[None, :, None] * stride_w_n
                 + ks[None, None, :])
    acc = tl.zeros([CHOICES, BLOCK_SIZE_N], dtype=tl.float32)
    for start in range(0, intermediate, BLOCK_SIZE_K):
        if EVEN_K:
            rows_ok = choices_ok[:, None]
        else:
            rows_ok = choices_ok[:, None] & (start + ks < intermediate)[None, :]
        rows = tl.load(row_ptrs + start, mask=rows_ok, other=0.0).to(tl.float32)
        tiles = tl.load(tile_ptrs + start, mask=rows_ok[:, None, :] & cols_ok[None, :, None], other=0.0)
        acc += tl.sum(tiles.to(tl.float32) * rows[:, None, :], axis=2)
    if scale_ptr is not None:  # fp8 weights: each choice's sums times its expert's row scales
        scales = tl.load(scale_ptr + experts[:, None] * stride_s_e + cols[None, :],
                         mask=choices_ok[:, None] & cols_ok[None, :], other=0.0)
        acc *= scales
    out = tl.sum(acc * routing.to(tl.float32)[:, None], axis=0)
    tl.store(out_ptr + token.to(tl.int64) * stride_o_t + cols, out.to(out_ptr.dtype.element_ty), mask=cols_ok)


def pair_experts(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                 topk_ids: torch.Tensor, config: MoeConfig, w13_scale: torch.Tensor | None = None,
                 w2_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The experts on arguments kernels/fused_moe.py's `fused_experts` has checked (T > 0);
    the scales with fp8 weights, None otherwise."""
    num_tokens, hidden_size = hidden.shape
    intermediate = w2.shape[2]
    top_k = topk_ids.shape[1]
    device = hidden.device
    block_n, block_k = config.block_size_n, config.block_size_k
    inter = torch.empty((num_tokens * top_k, intermediate), dtype=hidden.dtype, device=device)
    out = torch.empty((num_tokens, hidden_size), dtype=hidden.dtype, device=device)
    launch = dict(num_warps=config.num_warps, num_stages=config.num_stages)
    # The down program holds a tile for each of the K choices: as many elements in all as the
    # gate/up program's two tiles (more would spill registers).
    choices = next_power_of_2(top_k)
    down_block_k = max(16, min(block_k, 2 * block_k // choices))
    for_device(_pair_gate_up_kernel, device)[(num_tokens * top_k, triton.cdiv(intermediate, block_n))](
        hidden, w13, w13_scale, topk_ids, inter,
        top_k, hidden_size, intermediate,
        hidden.stride(0), w13.stride(0), w13.stride(1), stride_of(w13_scale, 0), topk_ids.stride(0), topk_ids.stride(1),
        inter.stride(0),
        BLOCK_SIZE_N=block_n, BLOCK_SIZE_K=block_k, EVEN_K=hidden_size % block_k == 0, **launch,
    )
    for_device(_pair_down_kernel, device)[(num_tokens, triton.cdiv(hidden_size, block_n))](
        inter, w2, w2_scale, topk_ids, topk_weights, out,
        top_k, hidden_size, intermediate,
        inter.stride(0), w2.stride(0), w2.stride(1), stride_of(w2_scale, 0), topk_ids.stride(0), topk_ids.stride(1),
        topk_weights.stride(0), topk_weights.stride(1), out.stride(0),
        CHOICES=choices, BLOCK_SIZE_N=block_n, BLOCK_SIZE_K=down_block_k,
        EVEN_K=intermediate % down_block_k == 0, **launch,
    )
    return out
