"""check_invariants() catches every way the block manager's state can be corrupted."""

from __future__ import annotations

import pytest

from spillway.worker.core.block_manager import BlockManager

from tests.worker.core.test_block_manager import h, make_manager


def _bump_ref_count(manager: BlockManager) -> None:
    manager.blocks[0].ref_count += 1


def _map_hash_to_wrong_block(manager: BlockManager) -> None:
    manager._cached[h("a0")] = manager.blocks[1]


def _hash_without_entry(manager: BlockManager) -> None:
    manager.blocks[2].block_hash = h("ghost")


def _block_twice_in_a_table(manager: BlockManager) -> None:
    manager._tables["a"].blocks.append(manager.blocks[0])
    manager._tables["a"].slots.append(0)
    manager.blocks[0].ref_count += 1


def _stale_slot_table(manager: BlockManager) -> None:
    manager._tables["a"].slots[2] = 5


def _shared_gpu_slot(manager: BlockManager) -> None:
    manager.blocks[1].gpu_slot = 0


def _gpu_slot_out_of_range(manager: BlockManager) -> None:
    manager.blocks[1].gpu_slot = 8


def _owned_slot_also_free(manager: BlockManager) -> None:
    manager._free_slots.append(1)


def _free_slot_lost(manager: BlockManager) -> None:
    manager._free_slots.pop()


def _shared_cpu_slot(manager: BlockManager) -> None:
    manager.blocks[0].cpu_slot = manager.blocks[1].cpu_slot = 0


def _cpu_slot_without_a_cpu_tier(manager: BlockManager) -> None:
    manager.blocks[0].cpu_slot = 0


def _referenced_block_without_a_gpu_slot(manager: BlockManager) -> None:
    manager.blocks[2].gpu_slot = None


def _cached_block_dropped_from_the_lru(manager: BlockManager) -> None:
    manager._lru.remove(manager.blocks[3])


def _free_block_dropped_from_the_pool(manager: BlockManager) -> None:
    manager._free_block_ids.remove(7)


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (_bump_ref_count, "ref_count"),
        (_map_hash_to_wrong_block, "hash"),
        (_hash_without_entry, "does not map"),
        (_block_twice_in_a_table, "twice in its table"),
        (_stale_slot_table, "slot table is stale"),
        (_shared_gpu_slot, "GPU slot is owned by two blocks"),
        (_gpu_slot_out_of_range, "GPU slot out of range"),
        (_owned_slot_also_free, "owned and free"),
        (_free_slot_lost, "GPU slots lost"),
        (_shared_cpu_slot, "CPU slot is owned by two blocks"),
        (_cpu_slot_without_a_cpu_tier, "CPU slot out of range"),
        (_referenced_block_without_a_gpu_slot, "referenced without a GPU slot"),
        (_cached_block_dropped_from_the_lru, "LRU membership"),
        (_free_block_dropped_from_the_pool, "free-pool membership"),
    ],
)
def test_check_invariants_catches_a_corrupted_state(corrupt, message):
    manager = make_manager()
    manager.allocate("a", 10)  # blocks 0, 1 committed, block 2 partial
    manager.commit("a", [h("a0"), h("a1")])
    manager.allocate("b", 4)  # block 3, cached once b is gone
    manager.commit("b", [h("b0")])
    manager.free("b")
    manager.check_invariants()
    corrupt(manager)
    with pytest.raises(AssertionError, match=message):
        manager.check_invariants()
