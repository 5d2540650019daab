"""A producer's answer to a pull (disaggregated prefill, worker/driver/engine.py `serve_kv_pull`):
the longest prefix of the hashes asked whose KV can be read now, and where each block's bytes
are, on either tier, in prompt order:

    prompt blocks   a      b      c      d      e
    where           GPU 4  GPU 9  CPU 2  GPU 1  (CPU 7, its store not landed: the prefix ends)
    gpu_reads       (4, 0) (9, 1)        (1, 3)
    cpu_reads                     (2, 2)

A block is read from its GPU slot when it has one and no load from the CPU tier is planned or on
its way into it; else from its CPU copy when the tier says its bytes are in host memory
(`KVTier.readable_copy`: a store planned, or taken and not landed, is not); else the prefix
ends there. A block loading back into the GPU is read from its CPU copy, complete by then.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from spillway.worker.core.block_lru import Block
from spillway.worker.core.tier import KVTier


@dataclass(frozen=True, slots=True)
class ReadablePrefix:
    """`num_blocks` blocks, as (slot, position in the prefix) pairs per pool: together the
    positions 0..num_blocks-1, each once. The slots hold those blocks until the next step is
    planned (no refs are taken): read them before."""

    num_blocks: int = 0
    gpu_reads: tuple[tuple[int, int], ...] = ()
    cpu_reads: tuple[tuple[int, int], ...] = ()


def readable_prefix(hits: Sequence[Block], tier: KVTier) -> ReadablePrefix:
    """The longest readable run of `hits` (a lookup's blocks, in prompt order), module doc."""
    gpu_reads, cpu_reads = [], []
    for position, block in enumerate(hits):
        if block.gpu_slot is not None and not block.load_batch:
            gpu_reads.append((block.gpu_slot, position))
        elif (cpu_slot := tier.readable_copy(block)) is not None:
            cpu_reads.append((cpu_slot, position))
        else:
            break
    return ReadablePrefix(len(gpu_reads) + len(cpu_reads), tuple(gpu_reads), tuple(cpu_reads))
