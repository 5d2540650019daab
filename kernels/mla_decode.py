"""Decode attention of DeepSeek's multi-head latent attention (MLA), absorbed, over a latent cache.

The cache holds one row a token, `D = kv_lora_rank + rope_dim` values (512 + 64 in the released
models), shared by every query head (worker/models/mla.py): a token's key is its whole row, its
value the first kv_lora_rank values. A head's query is D values (`[q_nope @ W_UK | q_pe]`):

    out[b, h] = softmax(q[b, h] . rows^T * scale) @ rows[:, :kv_lora_rank]    rows: b's context

Request b has `context_lens[b]` tokens in the cache (the new ones included, already written);
its Q queries (1, or k + 1 to verify k speculative tokens) are the last Q positions,
`context_lens[b] - Q + i`, causal among themselves. A request with context_len 0 (a padded
row) gets zeros.

Every head reads the same rows, so a program takes BLOCK_M (16 or 32, `rows_per_program`) of
a request's (query, head) pairs ("rows" of q, in the order query * heads + head) and loads
each cached row once for all of them:

    grid (cdiv(Q * heads, BLOCK_M), B, num_splits)
    a tile of BLOCK_N tokens:  latent [BLOCK_N, kv_lora_rank] and rope [BLOCK_N, rope_dim],
                               loaded once (D split in two powers of two: 576 = 512 + 64)
      scores [BLOCK_M, BLOCK_N]       = q_latent @ latent^T + q_rope @ rope^T
      acc    [BLOCK_M, kv_lora_rank] += softmax weights @ latent      (online softmax)

The row blocks of one (request, split) are the grid's fastest dimension: launched side by
side, they read the same rows at about the same time, so where a request has more rows than
one program takes (128 heads: 4 row blocks of 32) a row comes from memory once and from L2
for the others.

Splits and their reduction are paged_attention_decode.py's: split s of request b holds tokens
[s * L, (s + 1) * L) with L = ceil(context_len / num_splits) rounded up to a whole tile, keeps
(max, sum, acc) per row, and a second kernel combines the splits that hold tokens (split 0
always stores, even empty). The grid depends only on B, Q * heads and num_splits (chosen from
static sizes, `default_num_splits`), never on context_lens, so a launch can be captured in a
CUDA graph and replayed with new context lengths.

The cache holds q's dtype, or float8 e4m3 (kernels/fp8.py): its rows are converted to q's
dtype (exactly; float16 for a bfloat16 q) as they are loaded. A latent cache has no value
side, so none of its values are stored transposed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from spillway.kernels.attention_tile import softmax_step, split_bounds
from spillway.kernels.fp8 import FP8_E4M3, query_for_cache
from spillway.kernels.utils import (
    INDEX_DTYPES,
    KV_CACHE_DTYPES,
    check,
    check_tensor,
    dtypes_for_cache,
    for_device,
    is_power_of_two,
    multiprocessor_count,
    next_power_of_2,
    wait_for_inputs,
)

_LOG2E = 1.4426950408889634


@dataclass(frozen=True, slots=True)
class LaunchSettings:
    """A program's rows of q (BLOCK_M), the cached tokens of a tile (BLOCK_N), its warps and
    its pipeline stages."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def rows_per_program(num_rows: int) -> int:
    """BLOCK_M for requests of `num_rows` (queries x heads) rows: 16, the least a matrix-unit
    product takes, while they fit; else 32 (on 8 warps), so that each cached row a program
    loads serves twice the heads (128 heads read a row 4 times, from L2 after the first,
    rather than 8) at the same warps a multiprocessor as two programs of 16 rows on 4 warps.
    64 rows spill registers: the accumulator alone is [64, 512] float32."""
    return 16 if num_rows <= 16 else 32


def default_settings(num_rows: int, cache_dtype: torch.dtype) -> LaunchSettings:
    """The launch for requests of `num_rows` rows over a cache of `cache_dtype`.

    Compiled for sm_90 (rows of 512 + 64): over a 16-bit cache, 16 rows on 4 warps with tiles
    of 32 cached rows (36 KiB) and 3 stages (two tiles in shared memory: one copied while the
    other is used) take 230 registers a thread and 91 KiB, so two programs fit a
    multiprocessor; 32 rows on 8 warps, 207 registers and 110 KiB. Over a float8 cache Triton
    converts the latent tile in registers rather than copying it to shared memory, and 4
    warps spill; 8 do not. A float32 cache (the CPU tests') takes half the tokens a tile.
    """
    block_m = rows_per_program(num_rows)
    block_n = 16 if cache_dtype == torch.float32 else 32
    return LaunchSettings(block_m, block_n, 8 if block_m > 16 or cache_dtype == FP8_E4M3 else 4, 3)


@triton.jit
def tile_blocks(table, tile, end, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """The block id of each position `tile .. tile + BLOCK_N`; 0 (unread) at or past `end`."""
    tokens = tile + tl.arange(0, BLOCK_N)
    return tl.load(table + tokens // BLOCK_SIZE, mask=tokens < end, other=0)


@triton.jit
def load_rows(
    layer_base, blocks, tile, end, stride_c_block, stride_c_token, dtype: tl.constexpr, MASKED: tl.constexpr,
    LATENT_DIM: tl.constexpr, ROPE_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """The cached rows of positions `tile .. tile + BLOCK_N` (in blocks `blocks`) in `dtype`, as
    (latent [BLOCK_N, LATENT_DIM], rope [BLOCK_N, ROPE_DIM]). MASKED: positions at or past
    `end` read as 0, their rows unread."""
    tile = tl.multiple_of(tile, BLOCK_N)
    tokens = tile + tl.arange(0, BLOCK_N)
    rows = layer_base + (blocks.to(tl.int64) * stride_c_block + (tokens % BLOCK_SIZE) * stride_c_token)[:, None]
    latent_ptrs = rows + tl.arange(0, LATENT_DIM)[None, :]
    rope_ptrs = rows + LATENT_DIM + tl.arange(0, ROPE_DIM)[None, :]
    if MASKED:
        in_range = tokens < end
        latent = tl.load(latent_ptrs, mask=in_range[:, None], other=0.0)
        rope = tl.load(rope_ptrs, mask=in_range[:, None], other=0.0)
    else:
        latent = tl.load(latent_ptrs)
        rope = tl.load(rope_ptrs)
    return latent.to(dtype), rope.to(dtype)


@triton.jit
def attend_rows(
    q_latent, q_rope, latent, rope, acc, row_sum, row_max, tile, end, query_pos, qk_scale,
    MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One online-softmax step of q's rows over a tile of cached rows, which serve as keys
    (whole) and values (their latent part). MASKED hides the positions at or past `end` and
    those after each row's own (`query_pos`). Scores are in log2 units."""
    scores = tl.dot(q_latent, tl.trans(latent), input_precision=DOT_PRECISION)
    scores = tl.dot(q_rope, tl.trans(rope), acc=scores, input_precision=DOT_PRECISION) * qk_scale
    return softmax_step(scores, latent, acc, row_sum, row_max, tile, end, query_pos, MASKED, DOT_PRECISION)


@triton.jit
def attend_span(
    q_latent, q_rope, acc, row_sum, row_max, layer_base, table, start, unmasked_end, end, query_pos, qk_scale,
    stride_c_block, stride_c_token,
    LATENT_DIM: tl.constexpr, ROPE_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """The rows' online softmax over the cached tokens [start, end): whole tiles to
    `unmasked_end` unmasked and software-pipelined, the rest masked and not (a second pipelined
    loop would double the shared memory a program holds). Each tile's block ids are read one
    iteration ahead: rows whose addresses come from a load in the same iteration get a single
    buffer from Triton's pipeliner (no overlap of a tile's copy with the math of the one
    before); from a loop-carried value, NUM_STAGES - 1 buffers."""
    blocks = tile_blocks(table, start, end, BLOCK_SIZE, BLOCK_N)
    for tile in range(start, unmasked_end, BLOCK_N):
        latent, rope = load_rows(layer_base, blocks, tile, end, stride_c_block, stride_c_token, q_latent.dtype,
                                 False, LATENT_DIM, ROPE_DIM, BLOCK_SIZE, BLOCK_N)
        blocks = tile_blocks(table, tile + BLOCK_N, end, BLOCK_SIZE, BLOCK_N)
        acc, row_sum, row_max = attend_rows(q_latent, q_rope, latent, rope, acc, row_sum, row_max, tile, end,
                                            query_pos, qk_scale, False, DOT_PRECISION)
    for tile in tl.range(unmasked_end, end, BLOCK_N, num_stages=1):
        blocks = tile_blocks(table, tile, end, BLOCK_SIZE, BLOCK_N)
        latent, rope = load_rows(layer_base, blocks, tile, end, stride_c_block, stride_c_token, q_latent.dtype,
                                 True, LATENT_DIM, ROPE_DIM, BLOCK_SIZE, BLOCK_N)
        acc, row_sum, row_max = attend_rows(q_latent, q_rope, latent, rope, acc, row_sum, row_max, tile, end,
                                            query_pos, qk_scale, True, DOT_PRECISION)
    return acc, row_sum, row_max


@triton.jit
def _mla_decode_kernel(
    q_ptr, cache_ptr, block_tables_ptr, context_lens_ptr,
    out_ptr, part_max_ptr, part_sum_ptr, part_acc_ptr,
    stride_q_b, stride_q_q, stride_q_h, stride_c_block, stride_c_token, stride_bt, layer_offset, qk_scale,
    NUM_HEADS: tl.constexpr, QUERY_LEN: tl.constexpr, LATENT_DIM: tl.constexpr, ROPE_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    row_block = tl.program_id(0)
    seq = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq)

    # Row r of the request is query r // NUM_HEADS under head r % NUM_HEADS.
    rows = row_block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_valid = rows < QUERY_LEN * NUM_HEADS
    query = rows // NUM_HEADS
    head = rows % NUM_HEADS
    query_pos = context_len - QUERY_LEN + query
    q_rows = q_ptr + (seq.to(tl.int64) * stride_q_b + query * stride_q_q + head * stride_q_h)[:, None]
    latent_dims = tl.arange(0, LATENT_DIM)
    q_latent = tl.load(q_rows + latent_dims[None, :], mask=row_valid[:, None], other=0.0)
    q_rope = tl.load(q_rows + LATENT_DIM + tl.arange(0, ROPE_DIM)[None, :], mask=row_valid[:, None], other=0.0)
    q_latent = query_for_cache(q_latent, cache_ptr)
    q_rope = query_for_cache(q_rope, cache_ptr)

    start, end = split_bounds(context_len, split, NUM_SPLITS, BLOCK_N)
    row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, LATENT_DIM], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    layer_base = cache_ptr + layer_offset
    # Whole tiles every query sees (all but the last QUERY_LEN - 1 positions) need no mask and
    # are pipelined; the rest, at most two tiles, run masked and unpipelined, so that a second
    # pipelined loop does not double the shared memory a program holds.
    unmasked_end = start + tl.maximum(tl.minimum(end, context_len - QUERY_LEN + 1) - start, 0) // BLOCK_N * BLOCK_N
    acc, row_sum, row_max = attend_span(q_latent, q_rope, acc, row_sum, row_max, layer_base, table, start,
                                        unmasked_end, end, query_pos, qk_scale, stride_c_block, stride_c_token,
                                        LATENT_DIM, ROPE_DIM, BLOCK_SIZE, BLOCK_N, DOT_PRECISION)

    # out and the partials are [B, Q * NUM_HEADS] rows (+ LATENT_DIM for out and acc), contiguous.
    out_rows = seq.to(tl.int64) * (QUERY_LEN * NUM_HEADS) + rows
    if NUM_SPLITS == 1:
        out = acc / tl.where(row_sum == 0.0, 1.0, row_sum)[:, None]
        tl.store(out_ptr + out_rows[:, None] * LATENT_DIM + latent_dims[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=row_valid[:, None])
    else:
        # A split past the context stores nothing (the reduction does not read it), except split 0.
        stored = rows < tl.where((start < context_len) | (split == 0), QUERY_LEN * NUM_HEADS, 0)
        part_rows = out_rows * NUM_SPLITS + split
        tl.store(part_max_ptr + part_rows, row_max, mask=stored)
        tl.store(part_sum_ptr + part_rows, row_sum, mask=stored)
        tl.store(part_acc_ptr + part_rows[:, None] * LATENT_DIM + latent_dims[None, :], acc, mask=stored[:, None])


@triton.jit
def _reduce_splits_kernel(
    out_ptr, part_max_ptr, part_sum_ptr, part_acc_ptr, context_lens_ptr,
    ROWS_PER_SEQ: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, LATENT_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)  # one (request, query, head)
    dims = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    context_len = tl.load(context_lens_ptr + row // ROWS_PER_SEQ)
    splits = tl.arange(0, BLOCK_S)
    # Only the splits that hold tokens (at least split 0) stored partials.
    split_start, _ = split_bounds(context_len, splits, NUM_SPLITS, BLOCK_N)
    split_valid = (splits < NUM_SPLITS) & ((split_start < context_len) | (splits == 0))
    split_max = tl.load(part_max_ptr + row * NUM_SPLITS + splits, mask=split_valid, other=float("-inf"))
    split_sum = tl.load(part_sum_ptr + row * NUM_SPLITS + splits, mask=split_valid, other=0.0)
    split_acc = tl.load(part_acc_ptr + (row * NUM_SPLITS + splits)[:, None] * LATENT_DIM + dims[None, :],
                        mask=split_valid[:, None], other=0.0)
    total_max = tl.max(split_max, 0)
    shift = tl.where(total_max == float("-inf"), 0.0, total_max)
    weight = tl.math.exp2(split_max - shift)
    total = tl.sum(split_sum * weight, 0)
    out = tl.sum(split_acc * weight[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + row * LATENT_DIM + dims, out.to(out_ptr.dtype.element_ty))


def default_num_splits(batch_size: int, num_rows: int, max_context_len: int, kv_lora_rank: int, row_bytes: int,
                       device: torch.device, block_m: int | None = None) -> int:
    """Splits per request for `num_rows` (queries x heads) rows a request in programs of
    `block_m` rows (default `rows_per_program`), over cached rows of `row_bytes` bytes,
    contexts of at most `max_context_len` tokens (the block table's width).

    1 when the (request, row block) programs already number 1.5x the multiprocessors. Else
    about four programs a multiprocessor, as long as each split reads at least 8x the bytes of
    its partial results: a split writes `num_rows x kv_lora_rank` float32 that the reduction
    reads back, which for 128 heads is as much as ~450 bf16 rows of 576; then rounded down to
    a power of two, at most 64 (splits of power-of-two contexts stay even).

    Depends on static sizes only (batch size, heads, block table width, cache dtype) and the
    device, never on the context lengths, so a captured CUDA graph keeps a valid grid.
    """
    programs = max(1, batch_size * -(-num_rows // (block_m or rows_per_program(num_rows))))
    num_sms = multiprocessor_count(device)
    if 2 * programs >= 3 * num_sms:
        return 1
    partial_bytes = 2 * num_rows * kv_lora_rank * 4  # written, then read back
    min_split_len = max(1, -(-8 * partial_bytes // row_bytes))
    wanted = min(-(-4 * num_sms // programs), max(1, max_context_len // min_split_len), 64)
    return 1 << (wanted.bit_length() - 1)


def check_latent_args(q, kv_cache, layer, block_tables, context_lens, kv_lora_rank, scale, num_splits) -> None:
    check_tensor("kv_cache", kv_cache, ndim=6, dtypes=KV_CACHE_DTYPES, device=kv_cache.device)
    device = kv_cache.device
    check(kv_cache.is_contiguous(), "kv_cache must be contiguous")
    _, num_layers, sides, block_size, num_kv_heads, row_dim = kv_cache.shape
    check(sides == 1 and num_kv_heads == 1, "kv_cache must be a latent cache [num_blocks, num_layers, 1, "
          f"block_size, 1, kv_lora_rank + rope_dim], got shape {tuple(kv_cache.shape)}")
    check(isinstance(layer, int) and 0 <= layer < num_layers, f"layer {layer} out of range for {num_layers} layers")
    check(is_power_of_two(block_size), f"block_size must be a power of two, got {block_size}")
    check(isinstance(kv_lora_rank, int) and is_power_of_two(kv_lora_rank) and kv_lora_rank >= 16,
          f"kv_lora_rank must be a power of two >= 16, got {kv_lora_rank}")
    check(row_dim > kv_lora_rank, f"the cache's rows of {row_dim} values must be longer than kv_lora_rank "
          f"{kv_lora_rank}: the rest is the rope part")
    rope_dim = row_dim - kv_lora_rank
    check(is_power_of_two(rope_dim) and rope_dim >= 16, f"the rope part, {row_dim} - {kv_lora_rank} = {rope_dim} "
          "values, must be a power of two >= 16")
    check_tensor("q", q, ndim=(3, 4), dtypes=dtypes_for_cache(kv_cache.dtype), device=device)
    check(q.shape[-1] == row_dim, f"q's last dim is {q.shape[-1]}, the cache's rows {row_dim}")
    check(q.shape[-2] >= 1, f"q has no heads: shape {tuple(q.shape)}")
    batch_size = q.shape[0]
    check_tensor("block_tables", block_tables, ndim=2, dtypes=INDEX_DTYPES, device=device)
    check(block_tables.shape[0] == batch_size,
          f"block_tables has {block_tables.shape[0]} rows for {batch_size} requests")
    check_tensor("context_lens", context_lens, ndim=1, dtypes=(torch.int32,), device=device)
    check(context_lens.shape[0] == batch_size,
          f"context_lens has {context_lens.shape[0]} entries for {batch_size} requests")
    check(isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0,
          f"scale must be a positive finite number, got {scale}")
    check(num_splits is None or (isinstance(num_splits, int) and num_splits >= 1),
          f"num_splits must be None or a positive int, got {num_splits}")


def paged_mla_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    *,
    kv_lora_rank: int,
    scale: float,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Absorbed MLA attention of `q` `[B, heads, D]` (or `[B, Q, heads, D]`) over the latent
    cache `kv_cache` `[num_blocks, num_layers, 1, block_size, 1, D]`, `D = kv_lora_rank + rope_dim`.

    `block_tables` int32 or int64 `[B, max_blocks]`, `context_lens` int32 `[B]` (tokens in the
    cache, the Q new ones included). Returns a new contiguous tensor `[B, (Q,) heads,
    kv_lora_rank]` in q's dtype. `num_splits` None picks `default_num_splits`; no host read of
    device data happens either way. q may be a strided view with a contiguous last dim.
    """
    check_latent_args(q, kv_cache, layer, block_tables, context_lens, kv_lora_rank, scale, num_splits)
    q4 = q if q.dim() == 4 else q.unsqueeze(1)
    out = launch(q4, kv_cache, layer, block_tables, context_lens, kv_lora_rank, scale, num_splits)
    return out.view(*q.shape[:-1], kv_lora_rank)


def launch(q4, kv_cache, layer, block_tables, context_lens, kv_lora_rank, scale, num_splits,
           settings: LaunchSettings | None = None) -> torch.Tensor:
    """The kernels on arguments `paged_mla_decode` has checked (q as `[B, Q, heads, D]`);
    `settings` (default `default_settings`) are open for tuning runs."""
    batch_size, query_len, num_heads, row_dim = q4.shape
    block_size = kv_cache.shape[3]
    device = kv_cache.device
    num_rows = query_len * num_heads
    settings = settings or default_settings(num_rows, kv_cache.dtype)
    block_m, block_n = settings.block_m, settings.block_n
    if num_splits is None:
        num_splits = default_num_splits(batch_size, num_rows, block_tables.shape[1] * block_size, kv_lora_rank,
                                        row_dim * kv_cache.element_size(), device, block_m)
    out = torch.empty(batch_size, query_len, num_heads, kv_lora_rank, dtype=q4.dtype, device=device)
    if batch_size == 0 or query_len == 0:
        return out
    if num_splits > 1:
        part_max = torch.empty(batch_size * num_rows * num_splits, dtype=torch.float32, device=device)
        part_sum = torch.empty_like(part_max)
        part_acc = torch.empty(part_max.numel() * kv_lora_rank, dtype=torch.float32, device=device)
    else:
        part_max = part_sum = part_acc = out  # unused
    for_device(_mla_decode_kernel, device)[(triton.cdiv(num_rows, block_m), batch_size, num_splits)](
        q4, kv_cache, block_tables, context_lens,
        out, part_max, part_sum, part_acc,
        q4.stride(0), q4.stride(1), q4.stride(2), kv_cache.stride(0), kv_cache.stride(3),
        block_tables.stride(0), layer * kv_cache.stride(1), scale * _LOG2E,
        NUM_HEADS=num_heads, QUERY_LEN=query_len, LATENT_DIM=kv_lora_rank, ROPE_DIM=row_dim - kv_lora_rank,
        BLOCK_M=block_m, BLOCK_SIZE=block_size, BLOCK_N=block_n, NUM_SPLITS=num_splits,
        DOT_PRECISION="ieee" if q4.dtype == torch.float32 else "tf32",
        num_warps=settings.num_warps, num_stages=settings.num_stages,
    )
    if num_splits > 1:
        block_d = min(kv_lora_rank, 128)
        for_device(_reduce_splits_kernel, device)[(batch_size * num_rows, kv_lora_rank // block_d)](
            out, part_max, part_sum, part_acc, context_lens,
            ROWS_PER_SEQ=num_rows, NUM_SPLITS=num_splits, BLOCK_S=next_power_of_2(num_splits),
            LATENT_DIM=kv_lora_rank, BLOCK_D=block_d, BLOCK_N=block_n,
            num_warps=4,
        )
    return out


def paged_mla_decode_reference(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    *,
    kv_lora_rank: int,
    scale: float,
    num_splits: int | None = None,
) -> torch.Tensor:
    """`paged_mla_decode` in plain torch: float32 math, one request at a time, a float8 cache's
    rows upcast (exactly) like any other. `num_splits` is taken so that either function can
    stand for the other; the result does not depend on it."""
    q4 = q if q.dim() == 4 else q.unsqueeze(1)
    batch_size, query_len, num_heads, row_dim = q4.shape
    block_size = kv_cache.shape[3]
    out = torch.zeros(batch_size, query_len, num_heads, kv_lora_rank, dtype=torch.float32, device=q.device)
    for seq in range(batch_size):
        context_len = int(context_lens[seq])
        if context_len == 0:
            continue
        blocks = block_tables[seq, : math.ceil(context_len / block_size)].long()
        rows = kv_cache[blocks, layer, 0, :, 0].reshape(-1, row_dim)[:context_len].float()
        scores = torch.einsum("qhd,kd->qhk", q4[seq].float(), rows) * scale
        query_pos = torch.arange(context_len - query_len, context_len, device=q.device)
        visible = torch.arange(context_len, device=q.device)[None, :] <= query_pos[:, None]
        scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
        out[seq] = torch.einsum("qhk,kc->qhc", probs, rows[:, :kv_lora_rank])
    return out.to(q.dtype).view(*q.shape[:-1], kv_lora_rank)
