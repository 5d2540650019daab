"""The experts of a large batch: grouped tensor-core products over the pairs sorted by expert.

kernels/moe_align.py sorts the M = T K token-expert pairs into blocks of BLOCK_SIZE_M slots,
one expert per block. Then:

    gate/up: one program per (block, tile of BLOCK_SIZE_N columns j of I): the block's token
             rows times its expert's gate rows j and up rows I + j, silu(gate) * up in the
             epilogue; inter[slot, j], slot order
    down:    one program per (block, tile of H): inter rows times the expert's w2 rows, times
             each pair's routing weight; pair_out[pair, n], pair order
    sum:     out[t] = sum_k pair_out[t K + k] in float32 (skipped when K = 1: the down
             product writes out itself)

The grids cover every block any routing can need (moe_align.py); a block past the last used
one exits at once. Products accumulate in float32; float32 inputs multiply in IEEE float32.
FP8 weight tiles are widened to the rows' dtype as they are loaded (exact), and the float32
products scaled by the weight rows' scales in the epilogue.
GROUP_SIZE_M blocks run side by side on one column tile, so an expert with several blocks
has its weight tile read once from memory and the rest from L2.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from spillway.kernels.moe_align import PairAlignment, align_pairs
from spillway.kernels.moe_config import MoeConfig
from spillway.kernels.utils import for_device, next_power_of_2, stride_of, wait_for_inputs


@triton.jit
def _block_and_tile(num_blocks, num_tiles, GROUP_SIZE_M: tl.constexpr):
    """This program's (block, column tile): GROUP_SIZE_M blocks down one column tile, then the next tile."""
    pid = tl.program_id(0)
    per_group = GROUP_SIZE_M * num_tiles
    first_block = (pid // per_group) * GROUP_SIZE_M
    group_blocks = tl.minimum(num_blocks - first_block, GROUP_SIZE_M)
    return first_block + (pid % per_group) % group_blocks, (pid % per_group) // group_blocks


@triton.jit
def _block_products(rows_ptr, rows_ok, weight_ptr, second_offset, stride_w_n, cols_ok, length,
                    BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr, BLOCK_SIZE_K: tl.constexpr,
                    EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr, SECOND: tl.constexpr):
    """float32 `[BLOCK_SIZE_M, BLOCK_SIZE_N]` products of the block's rows (rows_ptr[m] points at
    row m, `length` entries) with the weight rows at weight_ptr + n * stride_w_n, and with
    SECOND, also with those `second_offset` further on (the up rows), each row tile loaded once.
    fp8 weights are multiplied unscaled, widened to the rows' dtype."""
    ks = tl.arange(0, BLOCK_SIZE_K)
    ns = tl.arange(0, BLOCK_SIZE_N)
    a_ptrs = rows_ptr[:, None] + ks[None, :]
    b_ptrs = weight_ptr + ns[None, :] * stride_w_n + ks[:, None]
    acc = tl.zeros([BLOCK_SIZE_M, BLOCK_SIZE_N], dtype=tl.float32)
    second = tl.zeros([BLOCK_SIZE_M, BLOCK_SIZE_N], dtype=tl.float32)
    for start in range(0, length, BLOCK_SIZE_K):
        if EVEN_K:
            a_mask = rows_ok[:, None]
            b_mask = cols_ok[None, :]
        else:
            k_ok = start + ks < length
            a_mask = rows_ok[:, None] & k_ok[None, :]
            b_mask = cols_ok[None, :] & k_ok[:, None]
        a = tl.load(a_ptrs, mask=a_mask, other=0.0)
        b = tl.load(b_ptrs, mask=b_mask, other=0.0).to(a.dtype)
        acc = tl.dot(a, b, acc=acc, input_precision=DOT_PRECISION)
        if SECOND:
            b = tl.load(b_ptrs + second_offset, mask=b_mask, other=0.0).to(a.dtype)
            second = tl.dot(a, b, acc=second, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_SIZE_K
        b_ptrs += BLOCK_SIZE_K
    return acc, second


@triton.jit(do_not_specialize=["num_pairs", "num_blocks"])
def _grouped_gate_up_kernel(
    hidden_ptr, w13_ptr, scale_ptr, inter_ptr, sorted_pairs_ptr, block_experts_ptr,
    num_pairs, top_k, hidden_size, intermediate, num_blocks,
    stride_h_t, stride_w_e, stride_w_n, stride_s_e, stride_i_slot,
    BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr, BLOCK_SIZE_K: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr, EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    block, tile = _block_and_tile(num_blocks, tl.cdiv(intermediate, BLOCK_SIZE_N), GROUP_SIZE_M)
    expert = tl.load(block_experts_ptr + block)
    if expert < 0:
        return
    slots = block * BLOCK_SIZE_M + tl.arange(0, BLOCK_SIZE_M)
    pairs = tl.load(sorted_pairs_ptr + slots)
    rows_ok = pairs < num_pairs
    cols = tile * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
    cols_ok = cols < intermediate
    rows_ptr = hidden_ptr + (pairs // top_k).to(tl.int64) * stride_h_t
    gate_ptr = w13_ptr + expert.to(tl.int64) * stride_w_e + (tile * BLOCK_SIZE_N).to(tl.int64) * stride_w_n
    gate, up = _block_products(rows_ptr, rows_ok, gate_ptr, intermediate * stride_w_n, stride_w_n, cols_ok,
                               hidden_size, BLOCK_SIZE_M, BLOCK_SIZE_N, BLOCK_SIZE_K, EVEN_K, DOT_PRECISION, True)
    if scale_ptr is not None:  # fp8 weights: a scale per row of w13, the gate rows' then the up rows'
        scale_ptrs = scale_ptr + expert.to(tl.int64) * stride_s_e + cols
        gate *= tl.load(scale_ptrs, mask=cols_ok, other=0.0)[None, :]
        up *= tl.load(scale_ptrs + intermediate, mask=cols_ok, other=0.0)[None, :]
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(inter_ptr + slots.to(tl.int64)[:, None] * stride_i_slot + cols[None, :],
             out.to(inter_ptr.dtype.element_ty), mask=rows_ok[:, None] & cols_ok[None, :])


@triton.jit(do_not_specialize=["num_pairs", "num_blocks"])
def _grouped_down_kernel(
    inter_ptr, w2_ptr, scale_ptr, weights_ptr, pair_out_ptr, sorted_pairs_ptr, block_experts_ptr,
    num_pairs, top_k, hidden_size, intermediate, num_blocks,
    stride_i_slot, stride_w_e, stride_w_n, stride_s_e, stride_wt_t, stride_wt_k, stride_o_pair,
    BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr, BLOCK_SIZE_K: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr, EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    block, tile = _block_and_tile(num_blocks, tl.cdiv(hidden_size, BLOCK_SIZE_N), GROUP_SIZE_M)
    expert = tl.load(block_experts_ptr + block)
    if expert < 0:
        return
    slots = block * BLOCK_SIZE_M + tl.arange(0, BLOCK_SIZE_M)
    pairs = tl.load(sorted_pairs_ptr + slots)
    rows_ok = pairs < num_pairs
    cols = tile * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
    cols_ok = cols < hidden_size
    rows_ptr = inter_ptr + slots.to(tl.int64) * stride_i_slot
    weight_ptr = w2_ptr + expert.to(tl.int64) * stride_w_e + (tile * BLOCK_SIZE_N).to(tl.int64) * stride_w_n
    acc, _ = _block_products(rows_ptr, rows_ok, weight_ptr, 0, stride_w_n, cols_ok, intermediate,
                             BLOCK_SIZE_M, BLOCK_SIZE_N, BLOCK_SIZE_K, EVEN_K, DOT_PRECISION, False)
    if scale_ptr is not None:  # fp8 weights: a scale per row of w2, before the routing weight
        acc *= tl.load(scale_ptr + expert.to(tl.int64) * stride_s_e + cols, mask=cols_ok, other=0.0)[None, :]
    routing = tl.load(weights_ptr + (pairs // top_k) * stride_wt_t + (pairs % top_k) * stride_wt_k,
                      mask=rows_ok, other=0.0).to(tl.float32)
    out = acc * routing[:, None]
    tl.store(pair_out_ptr + pairs.to(tl.int64)[:, None] * stride_o_pair + cols[None, :],
             out.to(pair_out_ptr.dtype.element_ty), mask=rows_ok[:, None] & cols_ok[None, :])


@triton.jit
def _sum_choices_kernel(
    pair_out_ptr, out_ptr, top_k, hidden_size, stride_p, stride_o,
    BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    """out[t] = sum over k of pair_out[t K + k], in float32, in order of k."""
    wait_for_inputs(PDL)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    cols_ok = cols < hidden_size
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for choice in range(top_k):
        row = tl.load(pair_out_ptr + (token * top_k + choice) * stride_p + cols, mask=cols_ok, other=0.0)
        acc += row.to(tl.float32)
    tl.store(out_ptr + token * stride_o + cols, acc.to(out_ptr.dtype.element_ty), mask=cols_ok)


def grouped_experts(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor, config: MoeConfig, w13_scale: torch.Tensor | None = None,
                    w2_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The experts on arguments kernels/fused_moe.py's `fused_experts` has checked (T > 0);
    the scales with fp8 weights, None otherwise."""
    num_tokens, hidden_size = hidden.shape
    num_experts, intermediate = w13.shape[0], w2.shape[2]
    top_k = topk_ids.shape[1]
    device = hidden.device
    alignment = align_pairs(topk_ids, num_experts, config.block_size_m)
    inter = torch.empty((alignment.sorted_pairs.shape[0], intermediate), dtype=hidden.dtype, device=device)
    out = torch.empty((num_tokens, hidden_size), dtype=hidden.dtype, device=device)
    pair_out = out if top_k == 1 else torch.empty((num_tokens * top_k, hidden_size), dtype=hidden.dtype,
                                                  device=device)
    _gate_up(hidden, w13, w13_scale, inter, alignment, top_k, config)
    _down(inter, w2, w2_scale, topk_weights, pair_out, alignment, top_k, config)
    if top_k > 1:
        block = min(1024, next_power_of_2(hidden_size))
        for_device(_sum_choices_kernel, device)[(num_tokens, triton.cdiv(hidden_size, block))](
            pair_out, out, top_k, hidden_size, pair_out.stride(0), out.stride(0), BLOCK=block, num_warps=4,
        )
    return out


def _tiles(config: MoeConfig, length: int, dtype: torch.dtype) -> dict:
    return dict(BLOCK_SIZE_M=config.block_size_m, BLOCK_SIZE_N=config.block_size_n,
                BLOCK_SIZE_K=config.block_size_k, GROUP_SIZE_M=config.group_size_m,
                EVEN_K=length % config.block_size_k == 0,
                DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32",
                num_warps=config.num_warps, num_stages=config.num_stages)


def _gate_up(hidden, w13, w13_scale, inter, alignment: PairAlignment, top_k: int, config: MoeConfig) -> None:
    num_blocks = alignment.block_experts.shape[0]
    intermediate = inter.shape[1]
    grid = (num_blocks * triton.cdiv(intermediate, config.block_size_n),)
    for_device(_grouped_gate_up_kernel, hidden.device)[grid](
        hidden, w13, w13_scale, inter, alignment.sorted_pairs, alignment.block_experts,
        hidden.shape[0] * top_k, top_k, hidden.shape[1], intermediate, num_blocks,
        hidden.stride(0), w13.stride(0), w13.stride(1), stride_of(w13_scale, 0), inter.stride(0),
        **_tiles(config, hidden.shape[1], hidden.dtype),
    )


def _down(inter, w2, w2_scale, topk_weights, pair_out, alignment: PairAlignment, top_k: int,
          config: MoeConfig) -> None:
    num_blocks = alignment.block_experts.shape[0]
    hidden_size, intermediate = w2.shape[1], w2.shape[2]
    grid = (num_blocks * triton.cdiv(hidden_size, config.block_size_n),)
    for_device(_grouped_down_kernel, inter.device)[grid](
        inter, w2, w2_scale, topk_weights, pair_out, alignment.sorted_pairs, alignment.block_experts,
        topk_weights.numel(), top_k, hidden_size, intermediate, num_blocks,
        inter.stride(0), w2.stride(0), w2.stride(1), stride_of(w2_scale, 0), topk_weights.stride(0),
        topk_weights.stride(1),
        pair_out.stride(0),
        **_tiles(config, intermediate, inter.dtype),
    )
