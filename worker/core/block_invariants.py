"""The block manager's invariants (worker/core/block_manager.py, module doc), checked by walking
every block: O(blocks), for tests and debug mode only. The check takes the manager's state as it
is: the blocks, the requests' tables, the LRU list, the free pools and the prefix cache."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

from spillway.protocol.messages import BlockHash
from spillway.worker.core.block_lru import Block, BlockLRU, BlockTable
from spillway.worker.core.cpu_slots import CpuTier


def check_invariants(blocks: list[Block], tables: Mapping[str, BlockTable], *, lru: BlockLRU,
                     free_block_ids: Sequence[int], free_slots: Sequence[int], cached: Mapping[BlockHash, Block],
                     num_gpu_blocks: int, num_cpu_blocks: int, enable_prefix_caching: bool,
                     tier: CpuTier | None) -> None:
    """Raise AssertionError on the first broken invariant."""
    in_lru_order = list(lru)
    _check(len(in_lru_order) == len(lru), "LRU list length differs from its count")
    _check(len(set(map(id, in_lru_order))) == len(in_lru_order), "a block is in the LRU list twice")
    free_ids = set(free_block_ids)
    _check(len(free_ids) == len(free_block_ids), "a block is in the free pool twice")
    refs = Counter(block.block_id for table in tables.values() for block in table.blocks)
    for block in blocks:
        name = f"block {block.block_id} (ref_count {block.ref_count})"
        _check(block.ref_count == refs[block.block_id], f"{name}: in {refs[block.block_id]} tables")
        in_lru = block.ref_count == 0 and block.gpu_slot is not None  # the GPU LRU
        _check(in_lru == (block.lru_prev is not None), f"{name}: LRU membership disagrees")
        _check(not in_lru or block.block_hash is not None, f"{name}: cached without a hash")
        _check(block.ref_count == 0 or block.gpu_slot is not None, f"{name}: referenced without a GPU slot")
        is_free = block.ref_count == 0 and block.gpu_slot is None and block.cpu_slot is None
        _check(is_free == (block.block_id in free_ids), f"{name}: free-pool membership disagrees")
        _check(not is_free or block.block_hash is None, f"{name}: free but holds a hash")
        if block.block_hash is not None:
            _check(cached.get(block.block_hash) is block, f"{name}: hash does not map to it")
    for block_hash, block in cached.items():
        _check(block.block_hash == block_hash, f"a hash maps to block {block.block_id} without it")
    _check(enable_prefix_caching or not cached, "hashes cached with caching off")
    _check_slots(blocks, free_slots, num_gpu_blocks, num_cpu_blocks, tier)
    num_referenced = sum(block.ref_count > 0 for block in blocks)
    num_free = len(free_slots) + len(lru)
    _check(num_referenced + num_free == num_gpu_blocks, "referenced + free != total")
    for request_id, table in tables.items():
        table_blocks, num_committed = table.blocks, table.num_committed
        _check(len(set(map(id, table_blocks))) == len(table_blocks),
               f"{request_id}: a block appears twice in its table")
        _check(table.slots == [block.gpu_slot for block in table_blocks], f"{request_id}: slot table is stale")
        _check(num_committed <= len(table_blocks), f"{request_id}: more blocks committed than held")
        _check(all(block.block_hash is None for block in table_blocks[num_committed:]),
               f"{request_id}: an uncommitted block holds a hash")


def _check_slots(blocks: list[Block], free_slots: Sequence[int], num_gpu_blocks: int, num_cpu_blocks: int,
                 tier: CpuTier | None) -> None:
    owned = [block.gpu_slot for block in blocks if block.gpu_slot is not None]
    free = list(free_slots)
    _check(len(set(owned)) == len(owned), "a GPU slot is owned by two blocks")
    _check(not set(owned) & set(free), "a GPU slot is owned and free")
    _check(len(set(free)) == len(free), "a GPU slot is free twice")
    _check(all(0 <= slot < num_gpu_blocks for slot in owned + free), "a GPU slot out of range")
    _check(len(owned) + len(free) == num_gpu_blocks, "GPU slots lost")
    cpu = [block.cpu_slot for block in blocks if block.cpu_slot is not None]
    _check(len(set(cpu)) == len(cpu), "a CPU slot is owned by two blocks")
    _check(all(0 <= slot < num_cpu_blocks for slot in cpu), "a CPU slot out of range")
    tier.check_invariants(blocks, _check)


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)
