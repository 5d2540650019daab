"""A KV pool's blocks as bytes in host memory, to send to another worker or to take from one
(disaggregated prefill: protocol/kv_transfer.py).

A block is one contiguous span of the pool, `[num_layers, kv_sides, block_size, kv_heads,
head_dim]` (the CPU tier's layout too), so a run of blocks is their bytes one after another, and
a producer's answer gathers blocks of both pools into one payload. On
CUDA both directions go through page-locked host memory and run on the current (compute)
stream: a read is ordered after every step launched before it and waited for; a write is
ordered before every step launched after it (which may read the blocks at once), and the host
does not wait for it. The staging memory comes from torch's caching host allocator, which keeps
a block until the copies queued on it have run.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from spillway.worker.kv_tier.block_copies import copy_blocks


@dataclass(frozen=True, slots=True)
class KvLayout:
    """What a pool's blocks must agree on to be copied between two workers' pools."""

    dtype: str  # torch's name: "bfloat16", "float8_e4m3fn"
    block_shape: tuple[int, ...]  # one block: [num_layers, kv_sides, block_size, kv_heads, head_dim]
    block_bytes: int

    @property
    def itemsize(self) -> int:
        """Bytes per value."""
        return self.block_bytes // math.prod(self.block_shape)

    @classmethod
    def of(cls, pool: torch.Tensor) -> KvLayout:
        return cls(str(pool.dtype).removeprefix("torch."), tuple(pool.shape[1:]), pool[0].nbytes)


def read_blocks(pool: torch.Tensor, reads: Sequence[tuple[int, int]], num_blocks: int,
                tier_pool: torch.Tensor | None = None, tier_reads: Sequence[tuple[int, int]] = ()) -> np.ndarray:
    """`num_blocks` blocks gathered as one array of bytes in new host memory: block `position`
    is `pool[slot]` for each `(slot, position)` of `reads`, `tier_pool[slot]` for each of
    `tier_reads` (the CPU tier's pool, in host memory already: copied on the host, no device
    round trip). On CUDA the pool's blocks are copied after every step queued so far, and the
    host waits for them. Nothing returned points into either pool: a slot may be rewritten as
    soon as this returns."""
    assert len(reads) + len(tier_reads) == num_blocks, f"{len(reads)} + {len(tier_reads)} reads for {num_blocks} blocks"
    from_device = pool.device.type == "cuda" and bool(reads)
    host = torch.empty((num_blocks, *pool.shape[1:]), dtype=pool.dtype, pin_memory=from_device)
    copy_blocks(pool, host, reads)
    if tier_reads:
        assert tier_pool is not None and tier_pool.device.type == "cpu" and tier_pool.shape[1:] == pool.shape[1:]
        copy_blocks(tier_pool, host, tier_reads)
    if from_device:
        copied = torch.cuda.Event()
        copied.record(torch.cuda.current_stream(pool.device))
        copied.synchronize()
    return host.view(torch.uint8).numpy().reshape(-1)


def write_blocks(pool: torch.Tensor, payload: memoryview | bytes, pairs: Sequence[tuple[int, int]]) -> None:
    """`pool[slot] = block index` of `payload` (blocks one after another, the pool's layout)
    for each `(index, slot)` of `pairs`; on CUDA queued on the current stream, before any step
    launched after it."""
    if not pairs:
        return
    block_bytes = pool[0].nbytes
    staged = torch.empty((len(pairs), *pool.shape[1:]), dtype=pool.dtype, pin_memory=pool.device.type == "cuda")
    take_payload_blocks(payload, block_bytes, [index for index, _ in pairs],
                        out=staged.view(torch.uint8).numpy().reshape(len(pairs), block_bytes))
    copy_blocks(staged, pool, [(position, slot) for position, (_, slot) in enumerate(pairs)])


def take_payload_blocks(payload: memoryview | bytes, block_bytes: int, indexes: Sequence[int],
                        out: np.ndarray | None = None) -> np.ndarray:
    """Blocks `indexes` of `payload` (blocks of `block_bytes` one after another), gathered in one
    pass into writable memory (`out`, or new): torch would warn on a tensor over a message's
    read-only bytes. The indexes lie in the payload (checked by the caller)."""
    blocks = np.frombuffer(payload, dtype=np.uint8, count=len(payload) // block_bytes * block_bytes)
    # (mode "clip": unbuffered, straight into `out`)
    return np.take(blocks.reshape(-1, block_bytes), list(indexes), axis=0, mode="clip", out=out)
