"""Decode attention over the paged KV cache: 1 query per sequence, or Q = k + 1 (speculation).

Request b has `context_lens[b]` tokens in the cache (the new ones included, already written);
its Q queries are the last Q positions, `context_lens[b] - Q + i`, causal among themselves.

One program handles one (request, KV head, split): every query head of that KV head and every
query of the request, `Q * group` rows, so each KV tile is read once for all of them.

    grid (B, num_kv_heads, num_splits)
    split s of request b: tokens [s * L, (s + 1) * L) with L = ceil(context_len / num_splits)
                          rounded up to a whole tile; each split keeps (max, sum, acc) per row
    reduce kernel:        out = sum_s e^(max_s - M) acc_s / sum_s e^(max_s - M) sum_s
                          over the splits that hold tokens (split 0 always stores, even empty)

The grid depends only on B, the KV head count and num_splits (chosen from B and the block
table's width, never from context_lens), so a launch can be captured in a CUDA graph and
replayed with new context lengths. A request with context_len 0 (a padded row) gets zeros.

Tiles of keys and values are read through kernels/attention_tile.py: whole tiles before the
last QUERY_LEN - 1 positions unmasked and software-pipelined, the rest masked and unpipelined
(ONE_LOOP, a tuning option, puts every tile through one masked, pipelined loop instead). The
cache holds q's dtype, or float8 e4m3: its keys and values are then converted to q's dtype
(exactly) as they are loaded, and the math is the same (kernels/fp8.py, which also gives the float8 cache's layout of values).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from spillway.kernels.attention_tile import attend_tile, kv_head_bases, load_kv_tile, split_bounds, tile_piece
from spillway.kernels.fp8 import FP8_E4M3, cache_values, query_for_cache
from spillway.kernels.utils import (
    check,
    check_cache,
    check_tensor,
    dtypes_for_cache,
    for_device,
    multiprocessor_count,
    next_power_of_2,
    wait_for_inputs,
)

_LOG2E = 1.4426950408889634


@triton.jit
def _decode_kernel(
    q_ptr, cache_ptr, block_tables_ptr, context_lens_ptr,
    out_ptr, part_max_ptr, part_sum_ptr, part_acc_ptr,
    stride_q_b, stride_q_q, stride_q_h,
    stride_c_block, stride_c_kv, stride_c_token, stride_c_head,
    stride_bt, layer_offset, qk_scale,
    NUM_HEADS: tl.constexpr, QUERY_LEN: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, PIECE: tl.constexpr, NUM_SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ONE_LOOP: tl.constexpr, MASKED_STAGES: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq)

    # Row r is query r // GROUP of query head kv_head * GROUP + r % GROUP.
    rows = tl.arange(0, BLOCK_M)
    query = rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_valid = rows < QUERY_LEN * GROUP
    query_pos = context_len - QUERY_LEN + query
    dims = tl.arange(0, HEAD_DIM)
    q_offsets = seq.to(tl.int64) * stride_q_b + query * stride_q_q + head * stride_q_h
    q = tl.load(q_ptr + q_offsets[:, None] + dims[None, :], mask=row_valid[:, None], other=0.0)
    q = query_for_cache(q, cache_ptr)

    start, end = split_bounds(context_len, split, NUM_SPLITS, BLOCK_N)
    row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    key_base, value_base = kv_head_bases(cache_ptr, layer_offset, kv_head, stride_c_kv, stride_c_token,
                                         stride_c_head, BLOCK_SIZE)
    # Whole tiles of keys every query sees (all but the last QUERY_LEN - 1) need no mask. The
    # rest, at most two tiles, run unpipelined (MASKED_STAGES 1): a second pipelined loop would
    # double the shared memory a program holds, and halve the programs resident on a
    # multiprocessor. ONE_LOOP instead sends every tile through the masked loop, pipelined.
    # Measured on an H200 (Qwen3-8B heads, tools/bench/kernels/attention.py), one loop is 4% faster
    # over a bf16 cache at batch 200 x 1,040, the same at 64 x 4,096 and 512 x 1,000-2,000,
    # 4-7% slower over a float8 cache.
    unmasked_end = start
    if not ONE_LOOP:
        unmasked_end += tl.maximum(tl.minimum(end, context_len - QUERY_LEN + 1) - start, 0) // BLOCK_N * BLOCK_N
        for tile in range(start, unmasked_end, BLOCK_N):
            k, v = load_kv_tile(key_base, value_base, table, tile, end, dims, stride_c_block, stride_c_token,
                                q.dtype, False, BLOCK_SIZE, BLOCK_N, PIECE)
            acc, row_sum, row_max = attend_tile(q, k, v, acc, row_sum, row_max, tile, end, query_pos, qk_scale,
                                                False, DOT_PRECISION)
    for tile in tl.range(unmasked_end, end, BLOCK_N, num_stages=MASKED_STAGES):
        k, v = load_kv_tile(key_base, value_base, table, tile, end, dims, stride_c_block, stride_c_token,
                            q.dtype, True, BLOCK_SIZE, BLOCK_N, PIECE)
        acc, row_sum, row_max = attend_tile(q, k, v, acc, row_sum, row_max, tile, end, query_pos, qk_scale,
                                            True, DOT_PRECISION)

    if NUM_SPLITS == 1:
        out = acc / tl.where(row_sum == 0.0, 1.0, row_sum)[:, None]
        # out is [B, Q, NUM_HEADS, HEAD_DIM], contiguous.
        out_rows = (seq.to(tl.int64) * QUERY_LEN + query) * NUM_HEADS + head
        tl.store(out_ptr + out_rows[:, None] * HEAD_DIM + dims[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=row_valid[:, None])
    else:
        # Partials are [B, Q, NUM_HEADS, NUM_SPLITS] (+ HEAD_DIM for acc), contiguous. A split
        # past the context stores nothing (the reduction does not read it), except split 0.
        stored = rows < tl.where((start < context_len) | (split == 0), QUERY_LEN * GROUP, 0)
        part_rows = ((seq.to(tl.int64) * QUERY_LEN + query) * NUM_HEADS + head) * NUM_SPLITS + split
        tl.store(part_max_ptr + part_rows, row_max, mask=stored)
        tl.store(part_sum_ptr + part_rows, row_sum, mask=stored)
        tl.store(part_acc_ptr + part_rows[:, None] * HEAD_DIM + dims[None, :], acc, mask=stored[:, None])


@triton.jit
def _reduce_splits_kernel(
    out_ptr, part_max_ptr, part_sum_ptr, part_acc_ptr, context_lens_ptr,
    ROWS_PER_SEQ: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)  # one (request, query, head)
    context_len = tl.load(context_lens_ptr + row // ROWS_PER_SEQ)
    splits = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, HEAD_DIM)
    # Only the splits that hold tokens (at least split 0) stored partials.
    split_start, _ = split_bounds(context_len, splits, NUM_SPLITS, BLOCK_N)
    split_valid = (splits < NUM_SPLITS) & ((split_start < context_len) | (splits == 0))
    split_max = tl.load(part_max_ptr + row * NUM_SPLITS + splits, mask=split_valid, other=float("-inf"))
    split_sum = tl.load(part_sum_ptr + row * NUM_SPLITS + splits, mask=split_valid, other=0.0)
    split_acc = tl.load(
        part_acc_ptr + (row * NUM_SPLITS + splits)[:, None] * HEAD_DIM + dims[None, :],
        mask=split_valid[:, None], other=0.0,
    )
    total_max = tl.max(split_max, 0)
    shift = tl.where(total_max == float("-inf"), 0.0, total_max)
    weight = tl.math.exp2(split_max - shift)
    total = tl.sum(split_sum * weight, 0)
    out = tl.sum(split_acc * weight[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + row * HEAD_DIM + dims, out.to(out_ptr.dtype.element_ty))


def default_num_splits(batch_size: int, num_kv_heads: int, max_context_len: int, device: torch.device) -> int:
    """Splits per request: 1 when the (request, KV head) programs already number 1.5x the
    multiprocessors, else about four programs per multiprocessor, each split at least 256
    tokens, rounded down to a power of two (splits of power-of-two contexts stay even).

    Depends on static sizes only (batch size, heads, block table width), never on the
    context lengths, so a captured CUDA graph keeps a valid grid. Measured on an H200 (132
    multiprocessors, Qwen3-8B heads, bf16): batch 64 x 4096 tokens reads KV at 97-100% of
    the copy bandwidth with 1 split, 93% with 2; batch 32 x 2048 (256 programs) is 5% faster
    with 1 split than 3; SmolLM2's 3 KV heads at batch 64 (192 programs) 35% slower with 1
    split than 2; batch 8 x 8192 best at 8 splits, batch 1 x 32k at 32-64.
    """
    programs = max(1, batch_size * num_kv_heads)
    num_sms = multiprocessor_count(device)
    if 2 * programs >= 3 * num_sms:
        return 1
    wanted = min(-(-4 * num_sms // programs), max(1, max_context_len // 256), 64)
    return 1 << (wanted.bit_length() - 1)


def _check_decode_args(q, kv_cache, layer, block_tables, context_lens) -> None:
    device = kv_cache.device
    check_cache(kv_cache, layer)
    num_kv_heads, head_dim = kv_cache.shape[4], kv_cache.shape[5]
    check_tensor("q", q, ndim=(3, 4), dtypes=dtypes_for_cache(kv_cache.dtype), device=device)
    check(q.shape[-1] == head_dim, f"q's head_dim is {q.shape[-1]}, the cache's {head_dim}")
    num_heads = q.shape[-2]
    check(num_heads % num_kv_heads == 0,
          f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    batch_size = q.shape[0]
    check_tensor("block_tables", block_tables, ndim=2, dtypes=(torch.int32,), device=device)
    check(block_tables.shape[0] == batch_size,
          f"block_tables has {block_tables.shape[0]} rows for {batch_size} requests")
    check_tensor("context_lens", context_lens, ndim=1, dtypes=(torch.int32,), device=device)
    check(context_lens.shape[0] == batch_size,
          f"context_lens has {context_lens.shape[0]} entries for {batch_size} requests")


def paged_decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Attention of `q` `[B, Q, heads, head_dim]` (or `[B, heads, head_dim]` for Q = 1).

    `block_tables` int32 `[B, max_blocks]`, `context_lens` int32 `[B]` (tokens in the cache,
    the Q new ones included). Returns a new contiguous tensor shaped like `q`. `num_splits`
    None picks `default_num_splits`; no host read of device data happens either way.
    q may be a strided view with a contiguous last dim.
    """
    _check_decode_args(q, kv_cache, layer, block_tables, context_lens)
    check(num_splits is None or (isinstance(num_splits, int) and num_splits >= 1),
          f"num_splits must be None or a positive int, got {num_splits}")
    q4 = q if q.dim() == 4 else q.unsqueeze(1)
    return launch(q4, kv_cache, layer, block_tables, context_lens, scale, num_splits).view(q.shape)


def launch(q4, kv_cache, layer, block_tables, context_lens, scale, num_splits,
           block_n=None, num_warps=None, num_stages=None, one_loop=False) -> torch.Tensor:
    """The kernels on arguments `paged_decode_attention` has checked (q as `[B, Q, heads,
    head_dim]`); the tile size, warps, stages and loop structure are open for tuning runs."""
    batch_size, query_len, num_heads, head_dim = q4.shape
    block_size, num_kv_heads = kv_cache.shape[3], kv_cache.shape[4]
    device = kv_cache.device
    if num_splits is None:
        num_splits = default_num_splits(batch_size, num_kv_heads, block_tables.shape[1] * block_size, device)
    out = torch.empty(q4.shape, dtype=q4.dtype, device=device)
    if batch_size == 0 or query_len == 0:
        return out
    rows = batch_size * query_len * num_heads
    if num_splits > 1:
        part_max = torch.empty(rows * num_splits, dtype=torch.float32, device=device)
        part_sum = torch.empty_like(part_max)
        part_acc = torch.empty(rows * num_splits * head_dim, dtype=torch.float32, device=device)
    else:
        part_max = part_sum = part_acc = out  # unused
    group = num_heads // num_kv_heads
    if kv_cache.dtype == FP8_E4M3:
        # Half the bytes of a tile: two warps a program (more programs resident), three stages
        # and tiles of 128 keys read fastest (H200, Qwen3-8B heads).
        num_warps, num_stages = num_warps or 2, num_stages or 3
        block_n = block_n or (128 if head_dim <= 128 else 64)
    else:
        num_warps, num_stages = num_warps or 4, num_stages or 2
        block_n = block_n or (64 if head_dim <= 128 else 32)
    for_device(_decode_kernel, device)[(batch_size, num_kv_heads, num_splits)](
        q4, kv_cache, block_tables, context_lens,
        out, part_max, part_sum, part_acc,
        q4.stride(0), q4.stride(1), q4.stride(2),
        kv_cache.stride(0), kv_cache.stride(2), kv_cache.stride(3), kv_cache.stride(4),
        block_tables.stride(0), layer * kv_cache.stride(1), scale * _LOG2E,
        NUM_HEADS=num_heads, QUERY_LEN=query_len, GROUP=group,
        BLOCK_M=max(16, next_power_of_2(query_len * group)), HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_N=block_n, PIECE=tile_piece(block_size, block_n), NUM_SPLITS=num_splits,
        DOT_PRECISION="ieee" if q4.dtype == torch.float32 else "tf32",
        ONE_LOOP=one_loop, MASKED_STAGES=num_stages if one_loop else 1,
        num_warps=num_warps, num_stages=num_stages,
    )
    if num_splits > 1:
        for_device(_reduce_splits_kernel, device)[(rows,)](
            out, part_max, part_sum, part_acc, context_lens,
            ROWS_PER_SEQ=query_len * num_heads, NUM_SPLITS=num_splits, BLOCK_S=next_power_of_2(num_splits),
            HEAD_DIM=head_dim, BLOCK_N=block_n,
            num_warps=4 if head_dim >= 128 else 2,
        )
    return out


def paged_decode_attention_reference(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """`paged_decode_attention` in plain torch (float32 math, one request at a time; a float8
    cache's keys and values are upcast, exactly, like any other)."""
    q4 = q if q.dim() == 4 else q.unsqueeze(1)
    batch_size, query_len, num_heads, head_dim = q4.shape
    block_size, num_kv_heads = kv_cache.shape[3], kv_cache.shape[4]
    out = torch.zeros(q4.shape, dtype=torch.float32, device=q.device)
    for seq in range(batch_size):
        context_len = int(context_lens[seq])
        if context_len == 0:
            continue
        blocks = block_tables[seq, : math.ceil(context_len / block_size)].long()
        keys = kv_cache[blocks, layer, 0].reshape(-1, num_kv_heads, head_dim)[:context_len].float()
        values = cache_values(kv_cache, layer)[blocks].reshape(-1, num_kv_heads, head_dim)[:context_len].float()
        keys = keys.repeat_interleave(num_heads // num_kv_heads, dim=1)
        values = values.repeat_interleave(num_heads // num_kv_heads, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q4[seq].float(), keys) * scale
        query_pos = torch.arange(context_len - query_len, context_len, device=q.device)
        visible = torch.arange(context_len, device=q.device)[None, :] <= query_pos[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
        out[seq] = torch.einsum("hqk,khd->qhd", probs, values)
    return out.to(q.dtype).view(q.shape)
