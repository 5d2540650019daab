"""KV blocks between workers of different tensor-parallel sizes: the KV heads regrouped.

A block travels in its producer's layout (worker/runner/kv_block_io.py for one rank,
worker/tp/kv_shards.py for N): one rank's `[layers, sides, block_size, heads, head_dim]`, or N
ranks' shares one after another, `[N, layers, sides, block_size, heads / N, head_dim]`. Rank r of
N holds heads `rank_heads(K, N, r)` of the model's K KV heads, as the model's sharding cuts them
(worker/models/tensor_parallel.py): K / N of them where N divides K, else the one head its query
heads read (replicated on N / K ranks; an MLA model's one latent head on every rank). A
consumer of another size takes the blocks by regrouping: every head taken from the first
producer rank holding it, then handed to each consumer rank holding it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def rank_heads(num_kv_heads: int, world_size: int, rank: int) -> range:
    """The KV heads rank `rank` of `world_size` holds (the model's sharding)."""
    if num_kv_heads >= world_size:
        per_rank = num_kv_heads // world_size
        return range(rank * per_rank, (rank + 1) * per_rank)
    head = rank * num_kv_heads // world_size
    return range(head, head + 1)


def _ranks_and_inner(block_shape: Sequence[int]) -> tuple[int, tuple[int, ...]]:
    """(ranks, one rank's block shape) of a block's shape in either layout."""
    shape = tuple(block_shape)
    return (1, shape) if len(shape) == 5 else (shape[0], shape[1:])


def can_regroup(source_shape: Sequence[int], target_shape: Sequence[int], num_kv_heads: int) -> bool:
    """Whether blocks of `source_shape` become blocks of `target_shape` by regrouping the heads
    of a model of `num_kv_heads` KV heads (both shapes as the sharding of their sizes makes them)."""
    (source_ranks, source), (target_ranks, target) = _ranks_and_inner(source_shape), _ranks_and_inner(target_shape)
    if len(source) != 5 or len(target) != 5 or source[:3] + source[4:] != target[:3] + target[4:]:
        return False
    return all(inner[3] == len(rank_heads(num_kv_heads, ranks, 0))
               for ranks, inner in ((source_ranks, source), (target_ranks, target)))


def regroup(payload: memoryview | bytes, num_blocks: int, source_shape: Sequence[int], target_shape: Sequence[int],
            num_kv_heads: int, itemsize: int) -> np.ndarray:
    """`num_blocks` blocks of `source_shape` in `payload` as blocks of `target_shape`, new memory
    (`can_regroup` holds)."""
    (source_ranks, source), (target_ranks, target) = _ranks_and_inner(source_shape), _ranks_and_inner(target_shape)
    layers, sides, block_size, _, head_dim = source
    row = head_dim * itemsize  # one head's values for one token, as bytes: any dtype moves alike
    count = num_blocks * source_ranks * int(np.prod(source)) * itemsize
    blocks = np.frombuffer(payload, dtype=np.uint8, count=count).reshape(
        num_blocks, source_ranks, layers, sides, block_size, source[3], row)
    whole = np.empty((num_blocks, layers, sides, block_size, num_kv_heads, row), dtype=np.uint8)
    for rank in range(source_ranks):
        heads = rank_heads(num_kv_heads, source_ranks, rank)
        whole[..., heads.start:heads.stop, :] = blocks[:, rank]
    out = np.empty((num_blocks, target_ranks, layers, sides, block_size, target[3], row), dtype=np.uint8)
    for rank in range(target_ranks):
        heads = rank_heads(num_kv_heads, target_ranks, rank)
        out[:, rank] = whole[..., heads.start:heads.stop, :]
    return out.reshape(-1)
