"""A tensor-parallel worker's KV blocks read and written whole, for another worker
(disaggregated prefill: worker/runner/kv_block_io.py is the one-rank case).

Each rank's pool holds its own KV heads of every block (its share: `[num_layers, kv_sides,
block_size, its kv_heads, head_dim]`, replicated heads included), at the same slots on every
rank. A block as it travels is the ranks' shares one after another, rank 0 first:

    block   [world_size, one rank's block]    `rank_layout`: the shape another worker matches

so only a worker of the same tensor-parallel size and head split takes it (a consumer checks
the layout: kv_pulls.answer_problem). Rank 0 broadcasts each read or write first
(worker/tp/channel.py); the other ranks run their share when they receive it:

    read    every rank selects its share of the blocks on its device, in order, from its GPU
            pool or its CPU tier (where a rank other than 0 first waits for its own stores:
            rank 0 knows only its own landed); rank 0 gathers them (a collective) and lays them
            out block by block in host memory
    write   rank 0 stages the blocks named, sends them to every rank (a broadcast), and each
            rank copies its share into its slots, on its current stream: after every step
            launched before, before every step launched after
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist

from spillway.worker.core.readable_prefix import ReadablePrefix
from spillway.worker.runner.kv_block_io import KvLayout, take_payload_blocks


def rank_layout(pool: torch.Tensor, world_size: int) -> KvLayout:
    """The layout of a block as a worker of `world_size` ranks, each with `pool`'s shape, sends it."""
    return KvLayout(str(pool.dtype).removeprefix("torch."), (world_size, *pool.shape[1:]),
                    world_size * pool[0].nbytes)


def read_own_share(pool: torch.Tensor, prefix: ReadablePrefix, tier_pool: torch.Tensor | None = None) -> torch.Tensor:
    """This rank's share of `prefix`'s blocks, in its order: uint8 `[num_blocks, share bytes]` on
    the pool's device; those held in the CPU tier from `tier_pool` (host memory, whose stores
    the caller knows landed), the others from the GPU pool."""
    share = torch.empty((prefix.num_blocks, pool[0].nbytes), dtype=torch.uint8, device=pool.device)
    for source, reads in ((pool, prefix.gpu_reads), (tier_pool, prefix.cpu_reads)):
        if reads:
            slots = torch.tensor([slot for slot, _ in reads], dtype=torch.int64, device=source.device)
            positions = torch.tensor([position for _, position in reads], dtype=torch.int64, device=pool.device)
            share.index_copy_(0, positions, _bytes_by_slot(source).index_select(0, slots).to(pool.device))
    return share


def send_own_share(pool: torch.Tensor, prefix: ReadablePrefix, tier_pool: torch.Tensor | None = None) -> None:
    """On a rank other than 0: its share of a read, to rank 0."""
    dist.gather(read_own_share(pool, prefix, tier_pool), dst=0)


def read_blocks_of_ranks(channel, pool: torch.Tensor, prefix: ReadablePrefix,
                         tier_pool: torch.Tensor | None = None) -> np.ndarray:
    """On rank 0: every rank's share of `prefix`'s blocks, block by block in host memory (the
    module's layout): GPU blocks after every step each rank launched before, CPU-tier blocks
    once each rank's stores landed."""
    channel.send_kv_read(prefix)
    own = read_own_share(pool, prefix, tier_pool)
    shares = [torch.empty_like(own) for _ in range(dist.get_world_size())]
    dist.gather(own, shares, dst=0)
    return torch.stack(shares, dim=1).cpu().numpy().reshape(-1)


def write_blocks_of_ranks(channel, pool: torch.Tensor, payload: memoryview | bytes,
                          pairs: Sequence[tuple[int, int]]) -> None:
    """On rank 0: block `index` of `payload` (the module's layout) into slot `slot` of every
    rank's pool, for each `(index, slot)` of `pairs`."""
    if not pairs:
        return
    world_size = dist.get_world_size()
    # The blocks named, to the device the group broadcasts from.
    staged = take_payload_blocks(payload, world_size * pool[0].nbytes, [index for index, _ in pairs])
    staged_blocks = torch.from_numpy(staged).to(pool.device)
    slots = [slot for _, slot in pairs]
    channel.send_kv_write(slots, staged_blocks.reshape(-1))
    write_own_share(pool, staged_blocks, 0, world_size, slots)


def write_own_share(pool: torch.Tensor, blocks: torch.Tensor, rank: int, world_size: int,
                    slots: Sequence[int]) -> None:
    """This rank's share of `blocks` (uint8, the module's layout, one block per slot) into its
    pool's `slots`, on the current stream."""
    shares = blocks.reshape(len(slots), world_size, -1)[:, rank]
    index = torch.tensor(list(slots), dtype=torch.int64, device=pool.device)
    _bytes_by_slot(pool).index_copy_(0, index, shares.contiguous())


def _bytes_by_slot(pool: torch.Tensor) -> torch.Tensor:
    """A view of the pool: one row of bytes per slot."""
    return pool.view(torch.uint8).view(pool.shape[0], -1)
