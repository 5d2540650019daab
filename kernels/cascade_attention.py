"""Cascade attention: a ragged batch whose sequences all begin with the same cached blocks reads
that shared prefix's keys and values once for every query row, not once per sequence.

The batch is the one kernels/paged_attention_prefill.py takes (rows of q packed sequence after
sequence), plus `prefix_len`: the first `prefix_len` positions of every sequence sit in the
same blocks (its block table's leading entries equal row 0's), and every new token lies at or
after it, so it sees the whole prefix: no causal mask there. Two launches:

    prefix pass   one program per (BLOCK_Q packed rows, KV head, key split): its rows, of any
                  sequences, times the GROUP query heads of the KV head, against keys
                  [s * L, (s + 1) * L) of the prefix, read through row 0's table; stores each
                  row's (max, sum, acc) for its split
    suffix pass   one program per (query tile, sequence, KV head), as in the prefill kernel
                  (its grid over the batch's query tiles, kernels/attention_tile.py),
                  over the sequence's own keys [P, seq_len) (causal); then it folds in the
                  prefix splits' partials, an online-softmax step each, and stores the output

P is `prefix_len` rounded down to whole tiles of the prefix pass (PREFIX_N keys, a multiple of
the suffix pass's BLOCK_N), so the prefix pass reads only
whole, unmasked tiles and the suffix starts on a tile; the few keys between P and
`prefix_len` are read per sequence. Scores are in log2 units, as in the other attention
kernels; a float8 cache is read as they read it (kernels/fp8.py).

`prefix_len` is read from device memory (an int32 [1]) and both grids are sized from static
shapes (q's rows, the sequences, `num_splits`), so one launch stays valid in a CUDA graph for
any prefix, 0 included. The split length L is found in-kernel: P / num_splits rounded up to
whole tiles, and at least MIN_SPLIT keys, so a short prefix in a graph sized for a long one
fills its first few splits; the splits past P hold no keys. Their programs exit at once and
the suffix pass merges only the ceil(P / L) splits that hold keys; prefix-pass programs whose
rows all lie past the step's last (`query_start_loc[B]`: a graph's padding) exit too.
"""

from __future__ import annotations

import math

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
from spillway.kernels.paged_attention_prefill import MIN_SPLIT, check_ragged_arguments, prefill_tile_sizes
from spillway.kernels.utils import check, check_tensor, for_device, next_power_of_2, wait_for_inputs

_LOG2E = 1.4426950408889634
# The prefix pass's query rows per program, keys per tile, warps, pipeline stages, and the waves
# of programs its key splits aim for: on an H200, 50 sequences x 4 new tokens on a 10k-token
# prefix (Qwen3-8B heads) took 126.4 us (both passes) with 128 rows, 64 keys, 4 warps, 3 stages
# and 4 splits, against 139.0 us with 2 stages and 8 splits (3 waves) and 184.8 us with 64 rows
# and 3 splits; tiles of 128 keys, 8 warps or 256 rows did no better
# (`tools/bench/kernels/attention.py --convoy --tune`, docs/performance.md).
PREFIX_ROWS = 128
PREFIX_N = 64
PREFIX_WARPS = 4
PREFIX_STAGES = 3
SPLIT_WAVES = 1.5
# The suffix pass's query rows per program. At 64 (16 tokens of 4 query heads a KV head) a
# sequence of a few new tokens leaves most of its program's rows empty: the convoy's cascade
# (50 x 4 new tokens on a 10k-token prefix) took 117.8 us a layer with 64 rows, 106.5 with 16;
# but a long query after thousands of its own keys re-reads them once per program: 2 x 128 new
# tokens after 3,000 own keys, 131.1 us with 64, 155.2 with 16 (tools/bench/kernels/graph_attention.py,
# docs/performance.md). So 16 rows only where every query fits one program of them.
SUFFIX_ROWS = 64
SHORT_SUFFIX_ROWS = 16


@triton.jit
def _prefix_splits(prefix_len_ptr, num_splits, PREFIX_N: tl.constexpr, MIN_SPLIT_LEN: tl.constexpr):
    """(P, L, the splits holding keys): the prefix in whole tiles of the prefix pass (PREFIX_N
    keys), the split length (module docstring) and ceil(P / L), from the prefix length in memory."""
    prefix_end = tl.load(prefix_len_ptr) // PREFIX_N * PREFIX_N
    split_len = tl.maximum(tl.cdiv(tl.cdiv(prefix_end, num_splits), PREFIX_N) * PREFIX_N, MIN_SPLIT_LEN)
    return prefix_end, split_len, tl.cdiv(prefix_end, split_len)


@triton.jit(do_not_specialize=["num_seqs", "num_splits"])
def _prefix_kernel(
    q_ptr, cache_ptr, table_ptr, query_start_loc_ptr, prefix_len_ptr, part_max_ptr, part_sum_ptr, part_acc_ptr,
    num_seqs, num_splits,
    stride_q_t, stride_q_h, stride_c_block, stride_c_kv, stride_c_token, stride_c_head, layer_offset, qk_scale,
    GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, PIECE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    NUM_HEADS: tl.constexpr, MIN_SPLIT_LEN: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    first_row = tl.program_id(0) * BLOCK_Q
    prefix_end, split_len, _ = _prefix_splits(prefix_len_ptr, num_splits, BLOCK_N, MIN_SPLIT_LEN)
    start = split * split_len
    num_rows = tl.load(query_start_loc_ptr + num_seqs)
    if start >= prefix_end or first_row >= num_rows:  # a split with no keys, rows past the step's
        return
    q, token, head, row_valid, q_rows, dims = load_query_rows(
        q_ptr, cache_ptr, 0, first_row, num_rows, kv_head, stride_q_t, stride_q_h, GROUP, BLOCK_Q, BLOCK_M, HEAD_DIM)

    row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    key_base, value_base = kv_head_bases(cache_ptr, layer_offset, kv_head, stride_c_kv, stride_c_token,
                                         stride_c_head, BLOCK_SIZE)
    end = tl.minimum(start + split_len, prefix_end)
    for tile in range(start, end, BLOCK_N):  # whole tiles: prefix_end and split_len are multiples of BLOCK_N
        k, v = load_kv_tile(key_base, value_base, table_ptr, tile, end, dims, stride_c_block, stride_c_token,
                            q.dtype, False, BLOCK_SIZE, BLOCK_N, PIECE)
        acc, row_sum, row_max = attend_tile(q, k, v, acc, row_sum, row_max, tile, end, token, qk_scale,
                                            False, DOT_PRECISION)
    # Partials are [rows, NUM_HEADS, num_splits] (+ HEAD_DIM for acc), contiguous.
    parts = (q_rows * NUM_HEADS + head) * num_splits + split
    tl.store(part_max_ptr + parts, row_max, mask=row_valid)
    tl.store(part_sum_ptr + parts, row_sum, mask=row_valid)
    tl.store(part_acc_ptr + parts[:, None] * HEAD_DIM + dims[None, :], acc, mask=row_valid[:, None])


@triton.jit(do_not_specialize=["num_seqs", "num_splits", "stride_bt"])
def _suffix_kernel(
    q_ptr, cache_ptr, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr, prefix_len_ptr, out_ptr,
    part_max_ptr, part_sum_ptr, part_acc_ptr, num_seqs, num_splits,
    stride_q_t, stride_q_h, stride_o_t, stride_o_h,
    stride_c_block, stride_c_kv, stride_c_token, stride_c_head, stride_bt, layer_offset, qk_scale,
    GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, PIECE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    NUM_HEADS: tl.constexpr, MIN_SPLIT_LEN: tl.constexpr, PREFIX_N: tl.constexpr, MAX_SEQS: tl.constexpr,
    FLAT: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    seq, q_tile, kv_head = find_query_tile(query_start_loc_ptr, num_seqs, BLOCK_Q, MAX_SEQS, FLAT)
    if seq >= num_seqs:
        return
    query_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - query_start
    first_token = q_tile * BLOCK_Q
    if first_token >= query_len:
        return
    cached_len = tl.load(seq_lens_ptr + seq) - query_len
    prefix_end, _, num_parts = _prefix_splits(prefix_len_ptr, num_splits, PREFIX_N, MIN_SPLIT_LEN)

    q, token, head, row_valid, q_rows, dims = load_query_rows(
        q_ptr, cache_ptr, query_start, first_token, query_len, kv_head, stride_q_t, stride_q_h,
        GROUP, BLOCK_Q, BLOCK_M, HEAD_DIM)
    query_pos = cached_len + token

    row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    key_base, value_base = kv_head_bases(cache_ptr, layer_offset, kv_head, stride_c_kv, stride_c_token,
                                         stride_c_head, BLOCK_SIZE)
    kv_end = cached_len + tl.minimum(first_token + BLOCK_Q, query_len)
    # Keys before the tile's first query position are visible to all its rows: no mask there.
    masked_start = tl.maximum(prefix_end, (cached_len + first_token) // BLOCK_N * BLOCK_N)
    for tile in range(prefix_end, masked_start, BLOCK_N):
        k, v = load_kv_tile(key_base, value_base, table, tile, kv_end, dims, stride_c_block, stride_c_token,
                            q.dtype, False, BLOCK_SIZE, BLOCK_N, PIECE)
        acc, row_sum, row_max = attend_tile(q, k, v, acc, row_sum, row_max, tile, kv_end, query_pos, qk_scale,
                                            False, DOT_PRECISION)
    for tile in range(masked_start, kv_end, BLOCK_N):
        k, v = load_kv_tile(key_base, value_base, table, tile, kv_end, dims, stride_c_block, stride_c_token,
                            q.dtype, True, BLOCK_SIZE, BLOCK_N, PIECE)
        acc, row_sum, row_max = attend_tile(q, k, v, acc, row_sum, row_max, tile, kv_end, query_pos, qk_scale,
                                            True, DOT_PRECISION)

    part_rows = (q_rows * NUM_HEADS + head) * num_splits
    for part in range(num_parts):  # the prefix splits' partials: one more online-softmax step each
        split_max = tl.load(part_max_ptr + part_rows + part, mask=row_valid, other=float("-inf"))
        split_sum = tl.load(part_sum_ptr + part_rows + part, mask=row_valid, other=0.0)
        split_acc = tl.load(part_acc_ptr + (part_rows + part)[:, None] * HEAD_DIM + dims[None, :],
                            mask=row_valid[:, None], other=0.0)
        new_max = tl.maximum(row_max, split_max)
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        alpha, beta = tl.math.exp2(row_max - shift), tl.math.exp2(split_max - shift)
        row_sum = row_sum * alpha + split_sum * beta
        acc = acc * alpha[:, None] + split_acc * beta[:, None]
        row_max = new_max

    out = acc / tl.where(row_sum == 0.0, 1.0, row_sum)[:, None]
    out_offsets = q_rows * stride_o_t + head * stride_o_h
    tl.store(out_ptr + out_offsets[:, None] + dims[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_valid[:, None])


def cascade_num_splits(num_rows: int, num_kv_heads: int, group: int, head_dim: int, prefix_len: int,
                       num_sms: int) -> int:
    """Key splits of the prefix: enough (row tile, KV head, split) programs to fill the
    multiprocessors about SPLIT_WAVES times, each split at least MIN_SPLIT keys, at most 16. Every split
    adds a partial per row and head to write and read back, so no more than that. A CUDA
    graph passes the longest prefix it may meet (its block tables' reach) and `num_rows` its
    bucket's: fixed by its shapes."""
    block_q = prefill_tile_sizes(group, head_dim, PREFIX_ROWS)[0]
    programs = max(1, -(-num_rows // block_q) * num_kv_heads)
    return max(1, min(math.ceil(SPLIT_WAVES * num_sms / programs), prefix_len // MIN_SPLIT, 16))


def short_query_tokens(group: int, head_dim: int) -> int:
    """The longest query (tokens) that one SHORT_SUFFIX_ROWS program holds: a step whose every
    query is at most this long may pass `suffix_rows=SHORT_SUFFIX_ROWS` (4 with 4 query heads a
    KV head)."""
    return prefill_tile_sizes(group, head_dim, SHORT_SUFFIX_ROWS)[0]


def suffix_rows_for(longest_query: int, group: int, head_dim: int) -> int:
    """The suffix pass's rows a program for a step whose longest query is `longest_query` tokens."""
    return SHORT_SUFFIX_ROWS if longest_query <= short_query_tokens(group, head_dim) else SUFFIX_ROWS


def cascade_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_query_len: int,
    prefix_len: torch.Tensor,
    num_splits: int,
    suffix_rows: int = SUFFIX_ROWS,
) -> torch.Tensor:
    """`paged_prefill_attention` (same arguments, same result) for a batch whose sequences share
    their first `prefix_len[0]` positions' blocks, each sequence's new tokens all at or after it
    (module docstring; the caller vouches for both: nothing is read back from the device).
    `prefix_len`: int32 [1] on the device, 0 allowed; `num_splits`: the prefix's key splits
    (`cascade_num_splits` picks them), which size the grid. `suffix_rows`: the suffix pass's
    query rows per program: SUFFIX_ROWS, or SHORT_SUFFIX_ROWS where no query is longer than
    `short_query_tokens` (each sequence's query then one program of a quarter the rows). Rows
    past `query_start_loc[B]` are left unspecified."""
    check_ragged_arguments(q, kv_cache, layer, query_start_loc, seq_lens, block_tables, max_query_len)
    check_tensor("prefix_len", prefix_len, ndim=1, dtypes=(torch.int32,), device=kv_cache.device)
    check(prefix_len.shape[0] == 1, f"prefix_len has {prefix_len.shape[0]} entries, expected 1")
    check(isinstance(num_splits, int) and num_splits >= 1, f"num_splits must be an int >= 1, got {num_splits}")
    check(suffix_rows in (SUFFIX_ROWS, SHORT_SUFFIX_ROWS),
          f"suffix_rows must be {SUFFIX_ROWS} or {SHORT_SUFFIX_ROWS}, got {suffix_rows}")
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if block_tables.shape[0] == 0 or max_query_len == 0 or q.shape[0] == 0:
        return out
    return launch(q, kv_cache, layer, query_start_loc, seq_lens, block_tables, scale, max_query_len, prefix_len,
                  num_splits, out, rows=suffix_rows)


def launch(q, kv_cache, layer, query_start_loc, seq_lens, block_tables, scale, max_query_len, prefix_len,
           num_splits, out, passes=("prefix", "suffix"), prefix_rows=PREFIX_ROWS, prefix_n=PREFIX_N,
           prefix_warps=PREFIX_WARPS, prefix_stages=PREFIX_STAGES, rows=SUFFIX_ROWS, num_warps=4,
           num_stages=2) -> torch.Tensor:
    """Both passes (or those named in `passes`, for timing one alone) on arguments
    `cascade_attention` has checked, into `out`; tile sizes, warps and stages are open for tuning
    runs."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, block_size = kv_cache.shape[4], kv_cache.shape[3]
    group = num_heads // num_kv_heads
    device = kv_cache.device
    part_rows = num_tokens * num_heads * num_splits
    parts = (torch.empty(part_rows, dtype=torch.float32, device=device),
             torch.empty(part_rows, dtype=torch.float32, device=device),
             torch.empty(part_rows * head_dim, dtype=torch.float32, device=device))
    cache_strides = (kv_cache.stride(0), kv_cache.stride(2), kv_cache.stride(3), kv_cache.stride(4))
    shapes = dict(GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, NUM_HEADS=num_heads,
                  DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", MIN_SPLIT_LEN=MIN_SPLIT)
    num_seqs = block_tables.shape[0]
    suffix_n = prefill_tile_sizes(group, head_dim, rows)[2]
    # The suffix starts at P, a whole number of the prefix pass's tiles: one of its own too.
    check(prefix_n % suffix_n == 0, f"the prefix pass's {prefix_n}-key tiles are not whole {suffix_n}-key tiles")
    if "prefix" in passes:
        block_q, block_m, _ = prefill_tile_sizes(group, head_dim, prefix_rows)
        grid = (triton.cdiv(num_tokens, block_q), num_kv_heads, num_splits)
        for_device(_prefix_kernel, device)[grid](
            q, kv_cache, block_tables, query_start_loc, prefix_len, *parts, num_seqs, num_splits,
            q.stride(0), q.stride(1), *cache_strides, layer * kv_cache.stride(1), scale * _LOG2E,
            BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=prefix_n, PIECE=tile_piece(block_size, prefix_n),
            num_warps=prefix_warps, num_stages=prefix_stages, **shapes,
        )
    if "suffix" in passes:
        block_q, block_m, block_n = prefill_tile_sizes(group, head_dim, rows)
        grid, flat = query_tile_grid(num_tokens, num_seqs, max_query_len, block_q, num_kv_heads)
        for_device(_suffix_kernel, device)[grid](
            q, kv_cache, block_tables, query_start_loc, seq_lens, prefix_len, out, *parts, num_seqs, num_splits,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), *cache_strides, block_tables.stride(0),
            layer * kv_cache.stride(1), scale * _LOG2E, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n,
            PIECE=tile_piece(block_size, block_n), PREFIX_N=prefix_n,
            MAX_SEQS=next_power_of_2(num_seqs) if flat else 1, FLAT=flat,
            num_warps=num_warps, num_stages=num_stages, **shapes,
        )
    return out
