"""A prefix-cache lookup's answer: the hit blocks and what allocating them will take, gathered
in the one pass over the hashes that finds them (a shared 10k-token prefix is 626 blocks, and
a burst of requests on it looks it up once each)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import islice

from spillway.protocol.messages import BlockHash
from spillway.worker.core.block_lru import Block


@dataclass(slots=True)
class CachedPrefix:
    """The longest cached prefix of a request's block hashes, as `BlockManager.look_up` found
    it. Valid until the manager's next allocation or release (`version`): those can evict a hit
    or change what it counts."""

    blocks: list[Block]
    version: int
    num_on_cpu: int = 0  # hits cached on the CPU only: each takes a GPU slot and a load
    num_unreferenced: int = 0  # hits on the GPU that no request holds: their slots leave the allocatable ones
    load_batch: int = 0  # the last load batch bringing a hit on the GPU in (0: none is on its way)

    def __len__(self) -> int:
        return len(self.blocks)

    @property
    def block_ids(self) -> list[int]:
        return [block.block_id for block in self.blocks]

    @property
    def num_on_gpu(self) -> int:
        return len(self.blocks) - self.num_on_cpu


def look_up(cached: dict[BlockHash, Block], block_hashes: Sequence[BlockHash], count: int,
            version: int) -> CachedPrefix:
    """The blocks of the longest prefix of `block_hashes[:count]` in `cached`."""
    blocks: list[Block] = []
    append, get = blocks.append, cached.get
    num_on_cpu = num_unreferenced = load_batch = 0
    for block_hash in islice(block_hashes, count):
        block = get(block_hash)
        if block is None:
            break
        append(block)
        if block.gpu_slot is None:
            num_on_cpu += 1
        else:
            if not block.ref_count:
                num_unreferenced += 1
            if block.load_batch > load_batch:  # still loading for a request that went first
                load_batch = block.load_batch
    return CachedPrefix(blocks, version, num_on_cpu, num_unreferenced, load_batch)


def current_prefix(cached: CachedPrefix | Sequence[int], blocks: list[Block], version: int) -> CachedPrefix:
    """Hits as a `CachedPrefix` of `version`: a lookup's, refused when stale; block ids (indexes
    of `blocks`), checked still cached and counted."""
    if isinstance(cached, CachedPrefix):
        if cached.version != version:
            raise ValueError("a prefix looked up before the cache last changed (an allocation, a release, a dropped"
                             " CPU copy): look it up again")
        return cached
    hits = [blocks[block_id] for block_id in cached]
    if any(block.block_hash is None for block in hits):
        raise ValueError("a cached prefix block was evicted since the lookup")
    return look_up({block.block_hash: block for block in hits}, [block.block_hash for block in hits], len(hits),
                   version)
