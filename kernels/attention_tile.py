"""What the paged attention kernels share: finding a program's query tile in a ragged batch,
loading its query rows, loading a tile of
keys and values through the block table, and one online-softmax step over it.

A tile is BLOCK_N consecutive token positions starting at a multiple of BLOCK_N:

    keys      [BLOCK_N, HEAD_DIM], one block id per token, HEAD_DIM contiguous
    values    the same, or in a float8 cache (values transposed per block, kernels/fp8.py)
              [HEAD_DIM, NB, PIECE] -> [BLOCK_N, HEAD_DIM]: NB pieces of PIECE =
              min(BLOCK_SIZE, BLOCK_N) tokens, each within one block, its tokens contiguous

Unmasked tiles lie wholly before `kv_end`. A masked tile reads only blocks that hold a
position before `kv_end`; its other keys read as 0, and its scores past `kv_end` as -inf.
Its values past `kv_end` read as 0, except in a float8 cache's last block: those are read
as they are (finite: kernels/fp8.py) and weighed by 0.
"""

from __future__ import annotations

import triton
import triton.language as tl

from spillway.kernels.fp8 import query_for_cache, value_offset


@triton.jit
def load_query_rows(q_ptr, cache_ptr, query_start, first_token, query_len, kv_head, stride_q_t, stride_q_h,
                    GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr):
    """A program's rows of queries: row r is token `first_token + r // GROUP` of the
    `query_len` packed from row `query_start` of q, under query head `kv_head * GROUP + r %
    GROUP`. Returns (q [BLOCK_M, HEAD_DIM] as the cache reads it, token, head, row_valid,
    q_rows (int64 rows of q), dims)."""
    rows = tl.arange(0, BLOCK_M)
    token = first_token + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_valid = (rows < BLOCK_Q * GROUP) & (token < query_len)
    dims = tl.arange(0, HEAD_DIM)
    q_rows = (query_start + token).to(tl.int64)
    q = tl.load(q_ptr + (q_rows * stride_q_t + head * stride_q_h)[:, None] + dims[None, :],
                mask=row_valid[:, None], other=0.0)
    return query_for_cache(q, cache_ptr), token, head, row_valid, q_rows, dims


@triton.jit
def find_query_tile(query_start_loc_ptr, num_seqs, BLOCK_Q: tl.constexpr, MAX_SEQS: tl.constexpr,
                    FLAT: tl.constexpr):
    """(sequence, query tile, the program's last grid index: KV head and split). FLAT: a grid
    (query tiles, heads) over the batch's query tiles, sequence after sequence (sequence s has
    ceil(query_len_s / BLOCK_Q), none for an empty one), so it needs no program per (sequence
    slot, longest query's tile); `MAX_SEQS` a power of two >= num_seqs; past the last tile:
    sequence `num_seqs` (a padding program, to exit). Otherwise a grid (tiles per sequence,
    sequence slots, heads), whose tiles past a sequence's query exit at once: no search, for
    grids that flattening would not shrink (`query_tile_grid`)."""
    if FLAT:
        tile = tl.program_id(0)
        seqs = tl.arange(0, MAX_SEQS)
        in_batch = seqs < num_seqs
        starts = tl.load(query_start_loc_ptr + seqs, mask=in_batch, other=0)
        ends = tl.load(query_start_loc_ptr + seqs + 1, mask=in_batch, other=0)
        tiles = tl.cdiv(ends - starts, BLOCK_Q)
        last = tl.cumsum(tiles, 0)  # one past each sequence's last tile
        seq = tl.sum((last <= tile).to(tl.int32), 0)
        first = tl.sum(tl.where(seqs == seq, last - tiles, 0), 0)
        return seq, tile - first, tl.program_id(1)
    else:
        return tl.program_id(1), tl.program_id(0), tl.program_id(2)


def query_tile_grid(num_tokens: int, num_seqs: int, max_query_len: int, block_q: int,
                    heads: int) -> tuple[tuple[int, ...], bool]:
    """(grid, FLAT) for `find_query_tile`, `heads` programs per tile. A sequence's last tile
    wastes fewer than `block_q` rows, so the rows' `num_tokens` (graph padding included) plus
    `num_seqs * (block_q - 1)` bound the batch's tiles; every sequence slot at `max_query_len`
    is the other grid. The flat grid where it has at most a quarter of the programs: its
    search adds ~1.7 us a layer to every program's start on an H200, where a program that
    exits at once costs a slot for ~1 us; a graph of many sequence slots, each query a few
    tokens, gains most."""
    tiles_per_seq = max(1, -(-max_query_len // block_q))
    by_rows = max(1, -(-(num_tokens + num_seqs * (block_q - 1)) // block_q))
    if 4 * by_rows <= tiles_per_seq * num_seqs:
        return (by_rows, heads), True
    return (tiles_per_seq, max(1, num_seqs), heads), False


@triton.jit
def kv_head_bases(cache_ptr, layer_offset, kv_head, stride_c_kv, stride_c_token, stride_c_head,
                  BLOCK_SIZE: tl.constexpr):
    """Pointers to KV head `kv_head`'s keys and values in block 0 of the layer."""
    key_base = cache_ptr + layer_offset + kv_head * stride_c_head
    value_base = cache_ptr + layer_offset + stride_c_kv + value_offset(
        cache_ptr, 0, kv_head, 0, stride_c_token, stride_c_head, BLOCK_SIZE)
    return key_base, value_base


@triton.jit
def load_kv_tile(
    key_base, value_base, table, tile, kv_end, dims, stride_c_block, stride_c_token, dtype: tl.constexpr,
    MASKED: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, PIECE: tl.constexpr,
):
    """Keys and values `[BLOCK_N, HEAD_DIM]` of positions `tile .. tile + BLOCK_N`, in `dtype`."""
    HEAD_DIM: tl.constexpr = dims.shape[0]
    tile = tl.multiple_of(tile, BLOCK_N)
    tokens = tile + tl.arange(0, BLOCK_N)
    if MASKED:
        in_range = tokens < kv_end
        blocks = tl.load(table + tokens // BLOCK_SIZE, mask=in_range, other=0).to(tl.int64)
    else:
        blocks = tl.load(table + tokens // BLOCK_SIZE).to(tl.int64)
    token_offsets = blocks * stride_c_block + (tokens % BLOCK_SIZE) * stride_c_token
    k_ptrs = key_base + token_offsets[:, None] + dims[None, :]
    if MASKED:
        k = tl.load(k_ptrs, mask=in_range[:, None], other=0.0).to(dtype)
    else:
        k = tl.load(k_ptrs).to(dtype)
    if value_base.dtype.element_ty != tl.float8e4nv:
        v_ptrs = value_base + token_offsets[:, None] + dims[None, :]
        if MASKED:
            v = tl.load(v_ptrs, mask=in_range[:, None], other=0.0).to(dtype)
        else:
            v = tl.load(v_ptrs).to(dtype)
    else:
        # Values transposed per block: read [HEAD_DIM, NB, PIECE], each piece's tokens contiguous.
        NB: tl.constexpr = BLOCK_N // PIECE
        slots = tl.arange(0, PIECE)
        piece_start = tile + tl.arange(0, NB) * PIECE
        if MASKED:
            piece_valid = piece_start < kv_end
            piece_blocks = tl.load(table + piece_start // BLOCK_SIZE, mask=piece_valid, other=0).to(tl.int64)
        else:
            piece_blocks = tl.load(table + piece_start // BLOCK_SIZE).to(tl.int64)
        piece_offsets = piece_blocks * stride_c_block + piece_start % BLOCK_SIZE
        v_ptrs = value_base + dims[:, None, None] * BLOCK_SIZE + piece_offsets[None, :, None] + slots[None, None, :]
        if MASKED:
            # Whole pieces (a mask constant along them keeps the copies wide). What lies past
            # kv_end in the last block is read: never NaN in a float8 cache (kernels/fp8.py),
            # its scores are masked, so it is weighed by 0.
            v = tl.load(v_ptrs, mask=piece_valid[None, :, None], other=0.0)
        else:
            v = tl.load(v_ptrs)
        v = tl.trans(tl.reshape(v, [HEAD_DIM, BLOCK_N])).to(dtype)
    return k, v


@triton.jit
def attend_tile(
    q, k, v, acc, row_sum, row_max, tile, kv_end, query_pos, qk_scale,
    MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One online-softmax step of q's rows over a tile's keys; MASKED hides the positions at
    or past kv_end and those after each row's own (`query_pos`). Scores are in log2 units."""
    scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    return softmax_step(scores, v, acc, row_sum, row_max, tile, kv_end, query_pos, MASKED, DOT_PRECISION)


@triton.jit
def softmax_step(
    scores, v, acc, row_sum, row_max, tile, kv_end, query_pos,
    MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """`attend_tile` from its scores `[rows, tile]` (log2 units) on: the mask, the online
    softmax and the values' product (kernels/mla_decode.py sums its scores from two parts)."""
    if MASKED:
        tokens = tile + tl.arange(0, v.shape[0])
        visible = (tokens[None, :] <= query_pos[:, None]) & (tokens < kv_end)[None, :]
        scores = tl.where(visible, scores, float("-inf"))
    new_max = tl.maximum(row_max, tl.max(scores, 1))
    # A row that has seen no visible key (a padded row) keeps max -inf: shift by 0, not NaN.
    shift = tl.where(new_max == float("-inf"), 0.0, new_max)
    p = tl.math.exp2(scores - shift[:, None])
    alpha = tl.math.exp2(row_max - shift)
    row_sum = row_sum * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, row_sum, new_max


@triton.jit
def split_bounds(context_len, split, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Tokens `[start, end)` of a decode kernel's `split`: splits of whole tiles, the last ones
    possibly empty."""
    split_len = tl.cdiv(tl.cdiv(context_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * split_len
    return start, tl.minimum(start + split_len, context_len)


def tile_piece(block_size: int, block_n: int) -> int:
    """PIECE for a tile of `block_n` keys over blocks of `block_size` (both powers of two)."""
    return min(block_size, block_n)
