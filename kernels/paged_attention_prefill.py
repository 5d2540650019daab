"""Prefill / extend attention over the paged KV cache for a ragged batch.

Sequence b owns query rows `query_start_loc[b] : query_start_loc[b + 1]` of q `[T, heads, D]`;
those rows are its last `query_len` positions `seq_lens[b] - query_len + i`, whose K/V are
already in the cache, possibly after a cached prefix. Each query attends causally to
positions `0 ..= its own`.

One program handles one (query tile, sequence, KV head). Where it shrinks the grid fourfold
(a CUDA graph of many sequence slots, each query a few tokens), the grid runs over the batch's
query tiles, sequence after sequence, instead of one program per (sequence slot, longest
query's tile) (attention_tile.find_query_tile). Its rows are BLOCK_Q query tokens
times the `group` query heads that share the KV head, so each K/V tile it reads through the
block table serves all of them (a sequence with one new token, a decode, costs one program
per KV head). Online softmax, flash-attention style, over tiles of BLOCK_N keys:

    rows (BLOCK_M = BLOCK_Q * group, padded to a power of two)
    r -> token r // group, head kv_head * group + r % group
    keys 0 .. (last query of the tile) are visited; tiles wholly before the tile's first query
    position skip the mask, the rest (the diagonal, the end of the context) apply it.

The cache holds q's dtype, or float8 e4m3: its keys and values are then converted to q's
dtype (exactly) as they are loaded, and the math is the same (kernels/fp8.py).

Split keys (`num_splits` > 1), for a few new tokens after a long cached prefix: a tile's
programs alone would each walk the whole context, one after another, on a handful of the
multiprocessors. Each (query tile, sequence, KV head) then has `num_splits` programs, split s
taking keys `[s * L, (s + 1) * L)` of the tile's `kv_end`, L = max(ceil(kv_end / num_splits)
rounded up to whole tiles, MIN_SPLIT); each stores its rows' (max, sum, acc) and split 0 the
number of splits that hold keys; a second kernel combines them, as decode attention does
(kernels/paged_attention_decode.py). Splits past a short context exit at once, so the grid,
sized from static shapes only, stays valid in a CUDA graph for any context.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from spillway.kernels.attention_tile import (
    attend_tile,
    find_query_tile,
    kv_head_bases,
    load_kv_tile,
    load_query_rows,
    query_tile_grid,
    tile_piece,
)
from spillway.kernels.utils import (
    check,
    check_cache,
    check_tensor,
    dtypes_for_cache,
    for_device,
    next_power_of_2,
    wait_for_inputs,
)

_LOG2E = 1.4426950408889634


MIN_SPLIT = 256  # keys: a split shorter than this costs more to combine than it saves


@triton.jit(do_not_specialize=["num_seqs"])
def _prefill_kernel(
    q_ptr, cache_ptr, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr, out_ptr,
    part_max_ptr, part_sum_ptr, part_acc_ptr, part_count_ptr, num_seqs,
    stride_q_t, stride_q_h, stride_o_t, stride_o_h,
    stride_c_block, stride_c_kv, stride_c_token, stride_c_head,
    stride_bt, layer_offset, qk_scale,
    GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, PIECE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    NUM_HEADS: tl.constexpr, NUM_SPLITS: tl.constexpr, MIN_SPLIT_LEN: tl.constexpr, MAX_SEQS: tl.constexpr,
    FLAT: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    seq, q_tile, head_split = find_query_tile(query_start_loc_ptr, num_seqs, BLOCK_Q, MAX_SEQS, FLAT)
    if seq >= num_seqs:
        return
    kv_head = head_split // NUM_SPLITS
    split = head_split % NUM_SPLITS
    query_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - query_start
    first_token = q_tile * BLOCK_Q
    if first_token >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix_len = seq_len - query_len

    q, token, head, row_valid, q_rows, dims = load_query_rows(
        q_ptr, cache_ptr, query_start, first_token, query_len, kv_head, stride_q_t, stride_q_h,
        GROUP, BLOCK_Q, BLOCK_M, HEAD_DIM)
    query_pos = prefix_len + token

    row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    key_base, value_base = kv_head_bases(cache_ptr, layer_offset, kv_head, stride_c_kv, stride_c_token,
                                         stride_c_head, BLOCK_SIZE)
    # Keys before the tile's first query position are visible to all its rows: no mask there.
    unmasked_end = (prefix_len + first_token) // BLOCK_N * BLOCK_N
    kv_end = prefix_len + tl.minimum(first_token + BLOCK_Q, query_len)
    start = 0
    end = kv_end
    if NUM_SPLITS > 1:
        split_len = tl.maximum(tl.cdiv(tl.cdiv(kv_end, NUM_SPLITS), BLOCK_N) * BLOCK_N, MIN_SPLIT_LEN)
        start = split * split_len
        if start >= kv_end:
            return
        end = tl.minimum(start + split_len, kv_end)
    masked_start = tl.maximum(start, tl.minimum(end, unmasked_end))
    for tile in range(start, masked_start, BLOCK_N):
        k, v = load_kv_tile(key_base, value_base, table, tile, end, dims, stride_c_block, stride_c_token,
                            q.dtype, False, BLOCK_SIZE, BLOCK_N, PIECE)
        acc, row_sum, row_max = attend_tile(q, k, v, acc, row_sum, row_max, tile, end, query_pos, qk_scale,
                                            False, DOT_PRECISION)
    for tile in range(masked_start, end, BLOCK_N):
        k, v = load_kv_tile(key_base, value_base, table, tile, end, dims, stride_c_block, stride_c_token,
                            q.dtype, True, BLOCK_SIZE, BLOCK_N, PIECE)
        acc, row_sum, row_max = attend_tile(q, k, v, acc, row_sum, row_max, tile, end, query_pos, qk_scale,
                                            True, DOT_PRECISION)

    if NUM_SPLITS == 1:
        out = acc / tl.where(row_sum == 0.0, 1.0, row_sum)[:, None]
        out_offsets = q_rows * stride_o_t + head * stride_o_h
        tl.store(out_ptr + out_offsets[:, None] + dims[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=row_valid[:, None])
    else:
        # Partials are [T, NUM_HEADS, NUM_SPLITS] (+ HEAD_DIM for acc), contiguous.
        part_rows = q_rows * NUM_HEADS + head
        parts = part_rows * NUM_SPLITS + split
        tl.store(part_max_ptr + parts, row_max, mask=row_valid)
        tl.store(part_sum_ptr + parts, row_sum, mask=row_valid)
        tl.store(part_acc_ptr + parts[:, None] * HEAD_DIM + dims[None, :], acc, mask=row_valid[:, None])
        if split == 0:
            count = tl.cdiv(kv_end, split_len) + tl.zeros([BLOCK_M], tl.int32)
            tl.store(part_count_ptr + part_rows, count, mask=row_valid)


@triton.jit
def _combine_splits_kernel(
    out_ptr, part_max_ptr, part_sum_ptr, part_acc_ptr, part_count_ptr, stride_o_t, stride_o_h,
    NUM_HEADS: tl.constexpr, NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr, PDL: tl.constexpr,
):
    """One program per (row, head): out = sum_s 2^(max_s - M) acc_s / sum_s 2^(max_s - M) sum_s
    over the splits that hold keys. Rows past the last sequence's have a count of 0: zeros."""
    wait_for_inputs(PDL)
    part_row = tl.program_id(0).to(tl.int64)
    splits = tl.arange(0, NUM_SPLITS)
    dims = tl.arange(0, HEAD_DIM)
    valid = splits < tl.load(part_count_ptr + part_row)
    parts = part_row * NUM_SPLITS + splits
    split_max = tl.load(part_max_ptr + parts, mask=valid, other=float("-inf"))
    split_sum = tl.load(part_sum_ptr + parts, mask=valid, other=0.0)
    split_acc = tl.load(part_acc_ptr + parts[:, None] * HEAD_DIM + dims[None, :], mask=valid[:, None], other=0.0)
    total_max = tl.max(split_max, 0)
    shift = tl.where(total_max == float("-inf"), 0.0, total_max)
    weight = tl.math.exp2(split_max - shift)
    total = tl.sum(split_sum * weight, 0)
    out = tl.sum(split_acc * weight[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    row, head = part_row // NUM_HEADS, part_row % NUM_HEADS
    tl.store(out_ptr + row * stride_o_t + head * stride_o_h + dims, out.to(out_ptr.dtype.element_ty))


def prefill_tile_sizes(group: int, head_dim: int, rows: int = 64) -> tuple[int, int, int]:
    """`(BLOCK_Q, BLOCK_M, BLOCK_N)`: query tokens per program, their rows (x group), keys per tile."""
    block_q = max(1, rows // next_power_of_2(group))
    block_m = max(16, next_power_of_2(block_q * group))
    block_n = 64 if head_dim <= 128 else 32
    return block_q, block_m, block_n


def paged_prefill_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_query_len: int,
    num_splits: int = 1,
) -> torch.Tensor:
    """Causal attention of the packed queries `q` `[T, heads, head_dim]`; returns a new tensor like q.

    `query_start_loc` int32 `[B + 1]`, `seq_lens` int32 `[B]` (context incl. the new tokens),
    `block_tables` int32 `[B, max_blocks]`, `max_query_len` a host int >= every query length
    (it sizes the grid; nothing is read back from the device), `num_splits` a power of two
    (module docstring; `prefill_num_splits` picks one). Rows past `query_start_loc[B]` are
    left unspecified. q may be a strided view with a contiguous last dim.
    """
    check_ragged_arguments(q, kv_cache, layer, query_start_loc, seq_lens, block_tables, max_query_len)
    check(isinstance(num_splits, int) and num_splits >= 1 and num_splits & (num_splits - 1) == 0,
          f"num_splits must be a power of two, got {num_splits}")
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if block_tables.shape[0] == 0 or max_query_len == 0 or q.shape[0] == 0:
        return out
    return launch(q, kv_cache, layer, query_start_loc, seq_lens, block_tables, scale, max_query_len, out,
                  num_splits)


def check_ragged_arguments(q, kv_cache, layer, query_start_loc, seq_lens, block_tables, max_query_len) -> None:
    """ValueError naming the argument unless they describe a ragged batch over `kv_cache`:
    what `paged_prefill_attention` and kernels/cascade_attention.py take."""
    device = kv_cache.device
    check_cache(kv_cache, layer)
    num_kv_heads, head_dim = kv_cache.shape[4], kv_cache.shape[5]
    check_tensor("q", q, ndim=3, dtypes=dtypes_for_cache(kv_cache.dtype), device=device)
    num_heads = q.shape[1]
    check(q.shape[2] == head_dim, f"q's head_dim is {q.shape[2]}, the cache's {head_dim}")
    check(num_heads % num_kv_heads == 0,
          f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    check_tensor("block_tables", block_tables, ndim=2, dtypes=(torch.int32,), device=device)
    num_seqs = block_tables.shape[0]
    expected_lengths = (("query_start_loc", query_start_loc, num_seqs + 1), ("seq_lens", seq_lens, num_seqs))
    for name, tensor, length in expected_lengths:
        check_tensor(name, tensor, ndim=1, dtypes=(torch.int32,), device=device)
        check(tensor.shape[0] == length, f"{name} has {tensor.shape[0]} entries, expected {length}")
    check(isinstance(max_query_len, int) and max_query_len >= 0,
          f"max_query_len must be an int >= 0, got {max_query_len}")


def launch(q, kv_cache, layer, query_start_loc, seq_lens, block_tables, scale, max_query_len, out,
           num_splits=1, rows=64, block_n=None, num_warps=4, num_stages=2,
           min_split_len=MIN_SPLIT) -> torch.Tensor:
    """The kernel on arguments `paged_prefill_attention` has checked, into `out`; tile sizes and
    warps are open for tuning runs."""
    num_kv_heads, head_dim = kv_cache.shape[4], kv_cache.shape[5]
    num_tokens, num_heads = q.shape[0], q.shape[1]
    group = num_heads // num_kv_heads
    block_q, block_m, default_block_n = prefill_tile_sizes(group, head_dim, rows)
    block_n = block_n or default_block_n
    device = kv_cache.device
    num_seqs = block_tables.shape[0]
    grid, flat = query_tile_grid(num_tokens, num_seqs, max_query_len, block_q, num_kv_heads * num_splits)
    parts = (out,) * 4  # unused without splits
    if num_splits > 1:
        part_rows = num_tokens * num_heads
        parts = (torch.empty(part_rows * num_splits, dtype=torch.float32, device=device),
                 torch.empty(part_rows * num_splits, dtype=torch.float32, device=device),
                 torch.empty(part_rows * num_splits * head_dim, dtype=torch.float32, device=device),
                 torch.zeros(part_rows, dtype=torch.int32, device=device))  # rows never written: 0 splits
    for_device(_prefill_kernel, device)[grid](
        q, kv_cache, block_tables, query_start_loc, seq_lens, out, *parts, num_seqs,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(0), kv_cache.stride(2), kv_cache.stride(3), kv_cache.stride(4),
        block_tables.stride(0), layer * kv_cache.stride(1), scale * _LOG2E,
        GROUP=group, BLOCK_Q=block_q, BLOCK_M=block_m, HEAD_DIM=head_dim, BLOCK_SIZE=kv_cache.shape[3],
        BLOCK_N=block_n, PIECE=tile_piece(kv_cache.shape[3], block_n), DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        NUM_HEADS=num_heads, NUM_SPLITS=num_splits, MIN_SPLIT_LEN=min_split_len,
        MAX_SEQS=next_power_of_2(num_seqs) if flat else 1, FLAT=flat, num_warps=num_warps, num_stages=num_stages,
    )
    if num_splits > 1:
        for_device(_combine_splits_kernel, device)[(num_tokens * num_heads,)](
            out, *parts, out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, NUM_SPLITS=num_splits, HEAD_DIM=head_dim,
        )
    return out


def prefill_num_splits(max_query_len: int, num_seqs: int, num_kv_heads: int, group: int, head_dim: int,
                       num_sms: int) -> int:
    """Key splits for a launch sized by static shapes (a CUDA graph's bucket): enough programs
    for one sequence's tiles to fill the multiprocessors about four times over, while the
    whole grid, padding sequences included, stays within 4,096 programs; at most 16, a power
    of two. 1 once one sequence's tiles alone fill the machine."""
    block_q = prefill_tile_sizes(group, head_dim)[0]
    tiles = -(-max_query_len // block_q) * num_kv_heads
    wanted = min(4 * num_sms // max(tiles, 1), 4096 // max(tiles * num_seqs, 1), 16)
    return 1 << (max(wanted, 1).bit_length() - 1)
