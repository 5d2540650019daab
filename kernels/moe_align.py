"""Token-expert pairs sorted by expert and padded into blocks of BLOCK_SIZE_M rows.

Pair p is token `p // K`'s choice `p % K` (K = topk_ids.shape[1]). The grouped products of
kernels/moe_grouped.py run one program per (block, column tile); each block holds pairs of
one expert only, so a program reads one expert's weights:

    topk_ids [[3, 1], [3, 0]], 4 experts, BLOCK_SIZE_M 4:
    expert 0: pair 3          slots 0..3   = [3, P, P, P]   block 0 -> expert 0
    expert 1: pair 1          slots 4..7   = [1, P, P, P]   block 1 -> expert 1
    expert 3: pairs 0, 2      slots 8..11  = [0, 2, P, P]   block 2 -> expert 3
                                                            block 3 -> -1 (past the end)

Pairs keep their order within an expert; P (padding) is the pair count M. The sizes depend
only on M, the expert count and BLOCK_SIZE_M, never on the ids, so a CUDA graph can hold the
launch: at most `M + min(E, M) * (BLOCK_SIZE_M - 1)` slots are needed (each expert that gets
pairs wastes at most BLOCK_SIZE_M - 1), and blocks past the last used one are marked -1.

A program takes its pairs SUB at a time (a `[SUB, E]` one-hot a piece, one after the other),
so the work is spread over chunks of pairs, as many as the device has multiprocessors and no
smaller than one piece: the pairs of one piece are sorted by one program in one launch, more
in two launches: each chunk counts its pairs per expert (and pads its share of the slots), then
each places its pairs after those of the chunks before it. (One program for a decode batch of
192 tokens at top 8 took 8 pieces one after the other: 97 us a layer on an H100, against the
few us of 24 chunks side by side.)

Expert ids must lie in [0, E): checking them on the device would need a host sync, so that is
the caller's duty; an id out of range is placed nowhere.

The counts that follow the token count (pairs, slots, chunks, blocks) are not specialised on
(`do_not_specialize`): a step of a new size reuses the compiled kernel instead of stalling on a
compile for a count that happens to be 1 or a multiple of 16. kernels/moe_grouped.py does the same.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from spillway.kernels.utils import (
    INDEX_DTYPES, check, check_tensor, for_device, multiprocessor_count, next_power_of_2, wait_for_inputs,
)

# Elements of the [pairs, experts] one-hot compare a program holds at once (64 a thread at 4 warps).
ONE_HOT_ELEMENTS = 8192


@dataclass(frozen=True, slots=True)
class PairAlignment:
    """Where each token-expert pair goes in the grouped products.

    sorted_pairs `[max_slots]` int32: the pair in each slot, or M (padding).
    block_experts `[max_slots // block_size_m]` int32: each block's expert, -1 past the end.
    num_padded `[1]` int32: the slots in use (blocks before num_padded / block_size_m).
    """

    sorted_pairs: torch.Tensor
    block_experts: torch.Tensor
    num_padded: torch.Tensor
    block_size_m: int


def max_slots(num_pairs: int, num_experts: int, block_size_m: int) -> int:
    """The slots any routing of `num_pairs` pairs can need: a whole number of blocks."""
    bound = num_pairs + min(num_experts, num_pairs) * (block_size_m - 1)
    return triton.cdiv(bound, block_size_m) * block_size_m


@triton.jit
def _load_ids(ids_ptr, pairs, num_pairs, top_k, stride_t, stride_k):
    """The expert of each pair, -1 past the last pair."""
    return tl.load(ids_ptr + (pairs // top_k) * stride_t + (pairs % top_k) * stride_k,
                   mask=pairs < num_pairs, other=-1).to(tl.int32)


@triton.jit
def _one_hot(ids, NUM_EXPERTS: tl.constexpr, E_BLOCK: tl.constexpr):
    """int32 `[pairs, E_BLOCK]`: 1 where a pair chose the column's expert (ids out of range match none)."""
    experts = tl.arange(0, E_BLOCK)
    return ((ids[:, None] == experts[None, :]) & (experts[None, :] < NUM_EXPERTS)).to(tl.int32)


@triton.jit
def _count_pairs(ids_ptr, first, last, num_pairs, top_k, stride_t, stride_k,
                 NUM_EXPERTS: tl.constexpr, E_BLOCK: tl.constexpr, SUB: tl.constexpr):
    """Pairs per expert among pairs [first, last)."""
    counts = tl.zeros([E_BLOCK], dtype=tl.int32)
    for start in range(first, last, SUB):
        pairs = start + tl.arange(0, SUB)
        ids = _load_ids(ids_ptr, pairs, tl.minimum(last, num_pairs), top_k, stride_t, stride_k)
        counts += tl.sum(_one_hot(ids, NUM_EXPERTS, E_BLOCK), axis=0)
    return counts


@triton.jit
def _pad_slots(sorted_ptr, first, last, padding, SUB: tl.constexpr):
    for start in range(first, last, SUB):
        slots = start + tl.arange(0, SUB)
        tl.store(sorted_ptr + slots, tl.full([SUB], 0, tl.int32) + padding, mask=slots < last)


@triton.jit
def _place_pairs(ids_ptr, sorted_ptr, first, last, num_pairs, top_k, stride_t, stride_k, next_slot,
                 NUM_EXPERTS: tl.constexpr, E_BLOCK: tl.constexpr, SUB: tl.constexpr):
    """Write pairs [first, last) into their experts' slots; `next_slot[e]` is where the
    first of them chosen by expert e goes."""
    for start in range(first, last, SUB):
        pairs = start + tl.arange(0, SUB)
        ids = _load_ids(ids_ptr, pairs, tl.minimum(last, num_pairs), top_k, stride_t, stride_k)
        one_hot = _one_hot(ids, NUM_EXPERTS, E_BLOCK)
        # A pair's slot: its expert's next slot plus the pairs before it in this piece with that expert.
        before = tl.cumsum(one_hot, axis=0) - one_hot + next_slot[None, :]
        slots = tl.sum(one_hot * before, axis=1)
        tl.store(sorted_ptr + slots, pairs, mask=tl.sum(one_hot, axis=1) > 0)
        next_slot += tl.sum(one_hot, axis=0)


@triton.jit
def _label_blocks(block_experts_ptr, ends, first, last,
                  BLOCK_SIZE_M: tl.constexpr, NUM_EXPERTS: tl.constexpr, E_BLOCK: tl.constexpr,
                  SUB: tl.constexpr):
    """Blocks [first, last): the expert whose padded slots hold the block's first slot (the
    number of experts ending at or before it), -1 past the last expert's end."""
    experts = tl.arange(0, E_BLOCK)
    for start in range(first, last, SUB):
        blocks = start + tl.arange(0, SUB)
        ended = (ends[None, :] <= blocks[:, None] * BLOCK_SIZE_M) & (experts[None, :] < NUM_EXPERTS)
        expert = tl.sum(ended.to(tl.int32), axis=1)
        tl.store(block_experts_ptr + blocks, tl.where(expert < NUM_EXPERTS, expert, -1), mask=blocks < last)


@triton.jit
def _padded_ends(counts, BLOCK_SIZE_M: tl.constexpr):
    """Per expert: the end of its slots, each expert's pairs rounded up to whole blocks."""
    return tl.cumsum(tl.cdiv(counts, BLOCK_SIZE_M) * BLOCK_SIZE_M, axis=0)


@triton.jit(do_not_specialize=["num_pairs", "num_slots"])
def _align_kernel(
    ids_ptr, sorted_ptr, block_experts_ptr, num_padded_ptr,
    num_pairs, top_k, stride_t, stride_k, num_slots,
    BLOCK_SIZE_M: tl.constexpr, NUM_EXPERTS: tl.constexpr, E_BLOCK: tl.constexpr, SUB: tl.constexpr,
    PDL: tl.constexpr,
):
    """All pairs in one program: count, pad, then place."""
    wait_for_inputs(PDL)
    counts = _count_pairs(ids_ptr, 0, num_pairs, num_pairs, top_k, stride_t, stride_k, NUM_EXPERTS, E_BLOCK, SUB)
    ends = _padded_ends(counts, BLOCK_SIZE_M)
    _pad_slots(sorted_ptr, 0, num_slots, num_pairs, 1024)
    tl.debug_barrier()  # every padding store lands before a pair's store to the same slot
    _place_pairs(ids_ptr, sorted_ptr, 0, num_pairs, num_pairs, top_k, stride_t, stride_k,
                 ends - tl.cdiv(counts, BLOCK_SIZE_M) * BLOCK_SIZE_M, NUM_EXPERTS, E_BLOCK, SUB)
    _label_blocks(block_experts_ptr, ends, 0, num_slots // BLOCK_SIZE_M, BLOCK_SIZE_M, NUM_EXPERTS, E_BLOCK, SUB)
    tl.store(num_padded_ptr, tl.max(ends, axis=0))


@triton.jit(do_not_specialize=["num_pairs", "num_slots", "pairs_per_chunk", "slots_per_chunk"])
def _count_chunks_kernel(
    ids_ptr, sorted_ptr, chunk_counts_ptr,
    num_pairs, top_k, stride_t, stride_k, num_slots, pairs_per_chunk, slots_per_chunk,
    NUM_EXPERTS: tl.constexpr, E_BLOCK: tl.constexpr, SUB: tl.constexpr, PDL: tl.constexpr,
):
    """Chunk c's pairs per expert into chunk_counts[c]; its share of the slots padded."""
    wait_for_inputs(PDL)
    chunk = tl.program_id(0)
    first = chunk * pairs_per_chunk
    counts = _count_pairs(ids_ptr, first, first + pairs_per_chunk, num_pairs, top_k, stride_t, stride_k,
                          NUM_EXPERTS, E_BLOCK, SUB)
    tl.store(chunk_counts_ptr + chunk * E_BLOCK + tl.arange(0, E_BLOCK), counts)
    first_slot = chunk * slots_per_chunk
    _pad_slots(sorted_ptr, first_slot, tl.minimum(first_slot + slots_per_chunk, num_slots), num_pairs, 1024)


@triton.jit(do_not_specialize=["num_pairs", "num_chunks", "pairs_per_chunk", "blocks_per_chunk",
                                     "num_blocks"])
def _place_chunks_kernel(
    ids_ptr, sorted_ptr, block_experts_ptr, num_padded_ptr, chunk_counts_ptr,
    num_pairs, top_k, stride_t, stride_k, num_chunks, pairs_per_chunk, blocks_per_chunk, num_blocks,
    BLOCK_SIZE_M: tl.constexpr, NUM_EXPERTS: tl.constexpr, E_BLOCK: tl.constexpr, SUB: tl.constexpr,
    CHUNK_ROWS: tl.constexpr, PDL: tl.constexpr,
):
    """Chunk c's pairs placed after the earlier chunks' pairs of the same expert; its share of
    the blocks labelled."""
    wait_for_inputs(PDL)
    chunk = tl.program_id(0)
    experts = tl.arange(0, E_BLOCK)
    totals = tl.zeros([E_BLOCK], dtype=tl.int32)
    earlier = tl.zeros([E_BLOCK], dtype=tl.int32)
    for start in range(0, num_chunks, CHUNK_ROWS):
        rows = start + tl.arange(0, CHUNK_ROWS)
        counts = tl.load(chunk_counts_ptr + rows[:, None] * E_BLOCK + experts[None, :],
                         mask=rows[:, None] < num_chunks, other=0)
        totals += tl.sum(counts, axis=0)
        earlier += tl.sum(tl.where(rows[:, None] < chunk, counts, 0), axis=0)
    ends = _padded_ends(totals, BLOCK_SIZE_M)
    starts = ends - tl.cdiv(totals, BLOCK_SIZE_M) * BLOCK_SIZE_M
    first = chunk * pairs_per_chunk
    _place_pairs(ids_ptr, sorted_ptr, first, first + pairs_per_chunk, num_pairs, top_k, stride_t, stride_k,
                 starts + earlier, NUM_EXPERTS, E_BLOCK, SUB)
    first_block = chunk * blocks_per_chunk
    _label_blocks(block_experts_ptr, ends, first_block, tl.minimum(first_block + blocks_per_chunk, num_blocks),
                  BLOCK_SIZE_M, NUM_EXPERTS, E_BLOCK, SUB)
    if chunk == 0:
        tl.store(num_padded_ptr, tl.max(ends, axis=0))


def pairs_per_chunk(num_pairs: int, sub: int, num_programs: int) -> int:
    """The pairs a program sorts: whole pieces of `sub`, spread over up to `num_programs`."""
    pieces = triton.cdiv(max(num_pairs, 1), sub)
    return sub * triton.cdiv(pieces, num_programs)


def align_pairs(
    topk_ids: torch.Tensor, num_experts: int, block_size_m: int, *, pairs_per_program: int | None = None
) -> PairAlignment:
    """Sort topk_ids' `[T, K]` token-expert pairs by expert into blocks of `block_size_m` slots
    (see the module's docstring); any strides, int32 or int64. `pairs_per_program` fixes the
    chunk size (by default, `pairs_per_chunk` over the device's multiprocessors)."""
    check_tensor("topk_ids", topk_ids, ndim=2, dtypes=INDEX_DTYPES, device=topk_ids.device, last_dim_contiguous=False)
    check(num_experts > 0, f"num_experts must be positive, got {num_experts}")
    check(block_size_m > 0 and block_size_m & (block_size_m - 1) == 0,
          f"block_size_m must be a power of two, got {block_size_m}")
    check(pairs_per_program is None or pairs_per_program > 0,
          f"pairs_per_program must be positive, got {pairs_per_program}")
    device = topk_ids.device
    num_pairs = topk_ids.numel()
    num_slots = max_slots(num_pairs, num_experts, block_size_m)
    if num_pairs == 0:
        empty = torch.zeros(0, dtype=torch.int32, device=device)
        return PairAlignment(empty, empty, torch.zeros(1, dtype=torch.int32, device=device), block_size_m)
    # Every entry is written by the kernels: no fill launched before them.
    alignment = PairAlignment(
        sorted_pairs=torch.empty(num_slots, dtype=torch.int32, device=device),
        block_experts=torch.empty(num_slots // block_size_m, dtype=torch.int32, device=device),
        num_padded=torch.empty(1, dtype=torch.int32, device=device),
        block_size_m=block_size_m,
    )
    e_block = next_power_of_2(num_experts)
    shape = dict(NUM_EXPERTS=num_experts, E_BLOCK=e_block,
                 SUB=max(1, min(256, ONE_HOT_ELEMENTS // e_block)))
    id_args = (num_pairs, topk_ids.shape[1], topk_ids.stride(0), topk_ids.stride(1))
    if pairs_per_program is None:
        pairs_per_program = pairs_per_chunk(num_pairs, shape["SUB"], multiprocessor_count(device))
    if num_pairs <= pairs_per_program:
        for_device(_align_kernel, device)[(1,)](
            topk_ids, alignment.sorted_pairs, alignment.block_experts, alignment.num_padded,
            *id_args, num_slots, BLOCK_SIZE_M=block_size_m, **shape, num_warps=4,
        )
        return alignment
    _align_in_chunks(topk_ids, alignment, id_args, pairs_per_program, shape)
    return alignment


def _align_in_chunks(topk_ids, alignment: PairAlignment, id_args, pairs_per_chunk, shape) -> None:
    device = topk_ids.device
    num_chunks = triton.cdiv(id_args[0], pairs_per_chunk)
    num_slots = alignment.sorted_pairs.shape[0]
    num_blocks = alignment.block_experts.shape[0]
    chunk_counts = torch.empty((num_chunks, shape["E_BLOCK"]), dtype=torch.int32, device=device)
    for_device(_count_chunks_kernel, device)[(num_chunks,)](
        topk_ids, alignment.sorted_pairs, chunk_counts,
        *id_args, num_slots, pairs_per_chunk, triton.cdiv(num_slots, num_chunks), **shape, num_warps=4,
    )
    for_device(_place_chunks_kernel, device)[(num_chunks,)](
        topk_ids, alignment.sorted_pairs, alignment.block_experts, alignment.num_padded, chunk_counts,
        *id_args, num_chunks, pairs_per_chunk, triton.cdiv(num_blocks, num_chunks), num_blocks,
        BLOCK_SIZE_M=alignment.block_size_m, **shape,
        CHUNK_ROWS=max(1, min(64, ONE_HOT_ELEMENTS // shape["E_BLOCK"])), num_warps=4,
    )


def align_pairs_reference(topk_ids: torch.Tensor, num_experts: int, block_size_m: int) -> PairAlignment:
    """`align_pairs` in plain torch: the same tensors, slot for slot."""
    device = topk_ids.device
    flat = topk_ids.reshape(-1).long().cpu()
    num_pairs = flat.numel()
    num_slots = max_slots(num_pairs, num_experts, block_size_m)
    sorted_pairs = torch.full((num_slots,), num_pairs, dtype=torch.int32)
    block_experts = torch.full((num_slots // block_size_m,), -1, dtype=torch.int32)
    slot = 0
    for expert in range(num_experts):
        pairs = torch.nonzero(flat == expert).flatten()
        sorted_pairs[slot : slot + len(pairs)] = pairs.int()
        padded = triton.cdiv(len(pairs), block_size_m) * block_size_m
        block_experts[slot // block_size_m : (slot + padded) // block_size_m] = expert
        slot += padded
    return PairAlignment(sorted_pairs.to(device), block_experts.to(device),
                         torch.tensor([slot], dtype=torch.int32, device=device), block_size_m)
