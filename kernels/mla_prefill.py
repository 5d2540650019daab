"""Prefill / extend attention of DeepSeek's multi-head latent attention (MLA), absorbed, over a
latent cache, for a ragged batch.

The cache and the math are kernels/mla_decode.py's: one row a token, `D = kv_lora_rank +
rope_dim` values, shared by every query head as its key (whole) and value (first kv_lora_rank
values). The batch is kernels/paged_attention_prefill.py's: sequence b owns rows
`query_start_loc[b] : query_start_loc[b + 1]` of q `[T, heads, D]`, its last `query_len`
positions `seq_lens[b] - query_len + i`, already in the cache, possibly after a cached prefix;
each attends causally to positions `0 ..= its own`.

A program takes a tile of BLOCK_Q query tokens of one sequence times a block of heads, as
decode takes queries x heads, and loads each cached row once for all of its rows:

    rows (BLOCK_M)   r -> token first_token + r // HEAD_BLOCK, head head_block * HEAD_BLOCK + r % HEAD_BLOCK
                     heads <= BLOCK_M: HEAD_BLOCK = heads, BLOCK_Q = BLOCK_M // heads tokens
                     more heads:       HEAD_BLOCK = BLOCK_M, BLOCK_Q = 1, ceil(heads / BLOCK_M) head blocks
    keys 0 .. (the tile's last query position), BLOCK_N a tile, online softmax:
      tiles wholly before the tile's first query position   unmasked, pipelined
      the rest (at most ceil(BLOCK_Q / BLOCK_N) + 1 tiles)   masked, unpipelined

A sequence's tiles run longest first (its last tokens see the most keys), so that the short
ones fill in behind them rather than leave a tail of long programs at the end.

The grid comes from static sizes only (attention_tile.query_tile_grid: T or max_query_len, B,
the head blocks), never from device values, so a launch can be captured in a CUDA graph and
replayed with new lengths; padding sequences (equal query_start_loc entries, seq_len 0) and
tiles past a sequence's query exit at once. Rows past `query_start_loc[B]` are not written.

The cache holds q's dtype, or float8 e4m3, converted as it is loaded (kernels/fp8.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from spillway.kernels.attention_tile import find_query_tile, query_tile_grid
from spillway.kernels.fp8 import query_for_cache
from spillway.kernels.mla_decode import (
    LaunchSettings,
    attend_span,
    check_latent_args,
    default_settings,
    paged_mla_decode_reference,
)
from spillway.kernels.utils import (
    INDEX_DTYPES,
    check,
    check_tensor,
    for_device,
    next_power_of_2,
    wait_for_inputs,
)

_LOG2E = 1.4426950408889634


@triton.jit(do_not_specialize=["num_seqs"])
def _mla_prefill_kernel(
    q_ptr, cache_ptr, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr, out_ptr, num_seqs,
    stride_q_t, stride_q_h, stride_c_block, stride_c_token, stride_bt, layer_offset, qk_scale,
    NUM_HEADS: tl.constexpr, HEAD_BLOCK: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    LATENT_DIM: tl.constexpr, ROPE_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    MAX_SEQS: tl.constexpr, FLAT: tl.constexpr, DOT_PRECISION: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    seq, q_tile, head_block = find_query_tile(query_start_loc_ptr, num_seqs, BLOCK_Q, MAX_SEQS, FLAT)
    if seq >= num_seqs:
        return
    query_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - query_start
    q_tile = tl.cdiv(query_len, BLOCK_Q) - 1 - q_tile  # longest first
    if q_tile < 0:
        return
    first_token = q_tile * BLOCK_Q
    prefix_len = tl.load(seq_lens_ptr + seq) - query_len

    rows = tl.arange(0, BLOCK_M)
    token = first_token + rows // HEAD_BLOCK
    head = head_block * HEAD_BLOCK + rows % HEAD_BLOCK
    row_valid = (rows < BLOCK_Q * HEAD_BLOCK) & (token < query_len) & (head < NUM_HEADS)
    q_rows = (query_start + token).to(tl.int64)
    q_base = q_ptr + (q_rows * stride_q_t + head * stride_q_h)[:, None]
    latent_dims = tl.arange(0, LATENT_DIM)
    q_latent = tl.load(q_base + latent_dims[None, :], mask=row_valid[:, None], other=0.0)
    q_rope = tl.load(q_base + LATENT_DIM + tl.arange(0, ROPE_DIM)[None, :], mask=row_valid[:, None], other=0.0)
    q_latent = query_for_cache(q_latent, cache_ptr)
    q_rope = query_for_cache(q_rope, cache_ptr)
    query_pos = prefix_len + token

    row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, LATENT_DIM], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    layer_base = cache_ptr + layer_offset
    kv_end = prefix_len + tl.minimum(first_token + BLOCK_Q, query_len)
    # Positions before the tile's first query are visible to all its rows: no mask there.
    unmasked_end = (prefix_len + first_token) // BLOCK_N * BLOCK_N
    acc, row_sum, row_max = attend_span(q_latent, q_rope, acc, row_sum, row_max, layer_base, table, 0, unmasked_end,
                                        kv_end, query_pos, qk_scale, stride_c_block, stride_c_token,
                                        LATENT_DIM, ROPE_DIM, BLOCK_SIZE, BLOCK_N, DOT_PRECISION)

    out = acc / tl.where(row_sum == 0.0, 1.0, row_sum)[:, None]
    out_rows = q_rows * NUM_HEADS + head  # out is [T, NUM_HEADS, LATENT_DIM], contiguous
    tl.store(out_ptr + out_rows[:, None] * LATENT_DIM + latent_dims[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_valid[:, None])


def tile_shape(num_heads: int, block_m: int) -> tuple[int, int, int]:
    """`(BLOCK_Q, HEAD_BLOCK, head blocks)` of programs of `block_m` rows (module docstring)."""
    if num_heads >= block_m:
        return 1, block_m, -(-num_heads // block_m)
    return block_m // num_heads, num_heads, 1


def default_prefill_settings(num_heads: int, max_query_len: int, cache_dtype: torch.dtype) -> LaunchSettings:
    """mla_decode's launch for programs of `max_query_len` tokens times `num_heads` heads, at most."""
    return default_settings(max_query_len * num_heads, cache_dtype)


def _check_ragged(q, kv_cache, query_start_loc, seq_lens, block_tables, max_query_len) -> None:
    check(isinstance(kv_cache, torch.Tensor), f"kv_cache must be a torch.Tensor, got {type(kv_cache).__name__}")
    device = kv_cache.device
    got = f"shape {tuple(q.shape)}" if isinstance(q, torch.Tensor) else type(q).__name__
    check(isinstance(q, torch.Tensor) and q.dim() == 3, f"q must be a tensor [tokens, heads, D], got {got}")
    check_tensor("block_tables", block_tables, ndim=2, dtypes=INDEX_DTYPES, device=device)
    num_seqs = block_tables.shape[0]
    for name, tensor, length in (("query_start_loc", query_start_loc, num_seqs + 1), ("seq_lens", seq_lens, num_seqs)):
        check_tensor(name, tensor, ndim=1, dtypes=(torch.int32,), device=device)
        check(tensor.shape[0] == length, f"{name} has {tensor.shape[0]} entries for {num_seqs} sequences, "
              f"expected {length}")
    check(isinstance(max_query_len, int) and max_query_len >= 0,
          f"max_query_len must be an int >= 0, got {max_query_len!r}")


def paged_mla_prefill(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    *,
    kv_lora_rank: int,
    scale: float,
    max_query_len: int,
) -> torch.Tensor:
    """Causal absorbed MLA attention of the packed queries `q` `[T, heads, D]` over the latent
    cache `kv_cache` `[num_blocks, num_layers, 1, block_size, 1, D]`, `D = kv_lora_rank + rope_dim`.

    `query_start_loc` int32 `[B + 1]`, `seq_lens` int32 `[B]` (context incl. the new tokens),
    `block_tables` int32 or int64 `[B, max_blocks]`, `max_query_len` a host int >= every query
    length (it sizes the grid; nothing is read back from the device). Returns a new contiguous
    tensor `[T, heads, kv_lora_rank]` in q's dtype; rows past `query_start_loc[B]` are left
    unspecified. q may be a strided view with a contiguous last dim.
    """
    _check_ragged(q, kv_cache, query_start_loc, seq_lens, block_tables, max_query_len)
    # mla_decode's checks of the cache, layer, ranks, q and scale, on the batch as it would see
    # it (every sequence with all T rows as its queries: the sizes it compares are the same).
    decode_view = q[None].expand(block_tables.shape[0], *q.shape)
    check_latent_args(decode_view, kv_cache, layer, block_tables, seq_lens, kv_lora_rank, scale, None)
    return launch(q, kv_cache, layer, query_start_loc, seq_lens, block_tables, kv_lora_rank, scale, max_query_len)


def launch(q, kv_cache, layer, query_start_loc, seq_lens, block_tables, kv_lora_rank, scale, max_query_len,
           settings: LaunchSettings | None = None) -> torch.Tensor:
    """The kernel on arguments `paged_mla_prefill` has checked; `settings` (default
    `default_prefill_settings`) are open for tuning runs."""
    num_tokens, num_heads, row_dim = q.shape
    num_seqs = block_tables.shape[0]
    device = kv_cache.device
    out = torch.empty(num_tokens, num_heads, kv_lora_rank, dtype=q.dtype, device=device)
    if num_seqs == 0 or num_tokens == 0 or max_query_len == 0:
        return out
    settings = settings or default_prefill_settings(num_heads, max_query_len, kv_cache.dtype)
    block_q, head_block, head_blocks = tile_shape(num_heads, settings.block_m)
    grid, flat = query_tile_grid(num_tokens, num_seqs, max_query_len, block_q, head_blocks)
    for_device(_mla_prefill_kernel, device)[grid](
        q, kv_cache, block_tables, query_start_loc, seq_lens, out, num_seqs,
        q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(3), block_tables.stride(0),
        layer * kv_cache.stride(1), scale * _LOG2E,
        NUM_HEADS=num_heads, HEAD_BLOCK=head_block, BLOCK_Q=block_q, BLOCK_M=settings.block_m,
        LATENT_DIM=kv_lora_rank, ROPE_DIM=row_dim - kv_lora_rank, BLOCK_SIZE=kv_cache.shape[3],
        BLOCK_N=settings.block_n, MAX_SEQS=next_power_of_2(num_seqs) if flat else 1, FLAT=flat,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=settings.num_warps, num_stages=settings.num_stages,
    )
    return out


def paged_mla_prefill_reference(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    *,
    kv_lora_rank: int,
    scale: float,
    max_query_len: int,
) -> torch.Tensor:
    """`paged_mla_prefill` in plain torch: each sequence's rows as the queries of one decode
    request (`paged_mla_decode_reference`: float32 math, its last query_len positions, causal
    among themselves). Rows past `query_start_loc[B]` are zeros; `max_query_len` is unused."""
    out = torch.zeros(q.shape[0], q.shape[1], kv_lora_rank, dtype=q.dtype, device=q.device)
    starts = query_start_loc.tolist()
    for seq in range(block_tables.shape[0]):
        rows = slice(starts[seq], starts[seq + 1])
        if rows.start == rows.stop:
            continue
        out[rows] = paged_mla_decode_reference(q[None, rows], kv_cache, layer, block_tables[seq : seq + 1],
                                               seq_lens[seq : seq + 1], kv_lora_rank=kv_lora_rank, scale=scale)[0]
    return out
