"""What the paged attention kernels share: loading a tile of keys and values through the block
table, and one online-softmax step over it.

A tile is BLOCK_N consecutive token positions starting at a multiple of BLOCK_N. It is read as
NB pieces of PIECE = min(BLOCK_SIZE, BLOCK_N) tokens, each within one block, so addresses come
from NB block ids and the pieces are contiguous runs Triton can copy in wide vectors:

    keys      [NB, PIECE, HEAD_DIM]   HEAD_DIM contiguous               -> [BLOCK_N, HEAD_DIM]
    values    the same, or in a float8 cache [HEAD_DIM, NB, PIECE]      -> [BLOCK_N, HEAD_DIM]
              (PIECE contiguous: the layout kernels/fp8.py describes)

Unmasked tiles lie wholly before `kv_end`. A masked tile reads only blocks that hold a
position before `kv_end`; the rest of its keys and values read as 0 and its scores as -inf.
"""

from __future__ import annotations

import triton
import triton.language as tl

from spillway.kernels.fp8 import value_offset


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
    NB: tl.constexpr = BLOCK_N // PIECE
    HEAD_DIM: tl.constexpr = dims.shape[0]
    slots = tl.arange(0, PIECE)
    piece_start = tile + tl.arange(0, NB) * PIECE
    if MASKED:
        piece_valid = piece_start < kv_end
        blocks = tl.load(table + piece_start // BLOCK_SIZE, mask=piece_valid, other=0).to(tl.int64)
        token_valid = (piece_start[:, None] + slots[None, :]) < kv_end
    else:
        blocks = tl.load(table + piece_start // BLOCK_SIZE).to(tl.int64)
    # Offset of each piece's first token: its block, then its place in the block.
    piece_offsets = blocks * stride_c_block + piece_start % BLOCK_SIZE * stride_c_token
    k_ptrs = key_base + piece_offsets[:, None, None] + slots[None, :, None] * stride_c_token + dims[None, None, :]
    if MASKED:
        k = tl.load(k_ptrs, mask=token_valid[:, :, None], other=0.0)
    else:
        k = tl.load(k_ptrs)
    k = tl.reshape(k, [BLOCK_N, HEAD_DIM]).to(dtype)
    if value_base.dtype.element_ty == tl.float8e4nv:
        # Values transposed per block: a piece's tokens are contiguous for each dim.
        value_offsets = blocks * stride_c_block + piece_start % BLOCK_SIZE
        v_ptrs = value_base + dims[:, None, None] * BLOCK_SIZE + value_offsets[None, :, None] + slots[None, None, :]
        if MASKED:
            # Whole pieces (a mask constant along them keeps the copies wide); what lies past
            # kv_end in the last block may be anything, even NaN, so it is zeroed after.
            v = tl.load(v_ptrs, mask=piece_valid[None, :, None], other=0.0)
        else:
            v = tl.load(v_ptrs)
        v = tl.trans(tl.reshape(v, [HEAD_DIM, BLOCK_N])).to(dtype)
        if MASKED:
            v = tl.where((tile + tl.arange(0, BLOCK_N) < kv_end)[:, None], v, 0.0)
    else:
        v_ptrs = value_base + piece_offsets[:, None, None] + slots[None, :, None] * stride_c_token + dims[None, None, :]
        if MASKED:
            v = tl.load(v_ptrs, mask=token_valid[:, :, None], other=0.0)
        else:
            v = tl.load(v_ptrs)
        v = tl.reshape(v, [BLOCK_N, HEAD_DIM]).to(dtype)
    return k, v


@triton.jit
def attend_tile(
    q, k, v, acc, row_sum, row_max, tile, kv_end, query_pos, qk_scale,
    MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One online-softmax step of q's rows over a tile's keys; MASKED hides the positions at
    or past kv_end and those after each row's own (`query_pos`). Scores are in log2 units."""
    scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    if MASKED:
        tokens = tile + tl.arange(0, k.shape[0])
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


def tile_piece(block_size: int, block_n: int) -> int:
    """PIECE for a tile of `block_n` keys over blocks of `block_size` (both powers of two)."""
    return min(block_size, block_n)
