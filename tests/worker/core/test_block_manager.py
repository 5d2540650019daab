from __future__ import annotations

import pytest

from spillway.protocol.messages import BlockHash
from spillway.worker.core.block_lru import Block
from spillway.worker.core.block_manager import BlockManager


def h(name: str) -> BlockHash:
    return BlockHash(name.encode())


def make_manager(num_gpu_blocks: int = 8, block_size: int = 4, enable_prefix_caching: bool = True) -> BlockManager:
    return BlockManager(num_gpu_blocks, block_size, enable_prefix_caching)


def block_in_slot(manager: BlockManager, slot: int) -> Block | None:
    owners = [block for block in manager.blocks if block.gpu_slot == slot]
    assert len(owners) <= 1
    return owners[0] if owners else None


def ref_counts(manager: BlockManager) -> list[int]:
    """Per GPU slot: the references to the block in it (0 for a free slot)."""
    blocks = [block_in_slot(manager, slot) for slot in range(manager.num_gpu_blocks)]
    return [block.ref_count if block else 0 for block in blocks]


def test_fresh_blocks_come_in_id_order_and_only_as_many_as_needed():
    manager = make_manager()
    assert manager.allocate("a", 10)
    assert manager.slot_table("a") == [0, 1, 2]
    assert manager.allocate("b", 1)
    assert manager.slot_table("b") == [3]
    assert manager.allocate("a", 12)  # still fits in three blocks
    assert manager.slot_table("a") == [0, 1, 2]
    assert manager.allocate("a", 13)
    assert manager.slot_table("a") == [0, 1, 2, 4]
    assert manager.free_gpu_slots() == [5, 6, 7]
    assert manager.num_free_blocks == 3
    assert manager.usage == 5 / 8
    manager.check_invariants()


def test_release_is_tail_first_and_unhashed_blocks_go_to_the_head():
    manager = make_manager()
    manager.allocate("a", 10)  # [0, 1, 2]; block 2 is partial
    manager.commit("a", [h("a0"), h("a1")])
    manager.allocate("b", 4)  # [3]
    manager.free("a")
    # 2 can never be hit: reused first. 1 covers more tokens than 0: evicted before it.
    assert manager.free_gpu_slots() == [2, 4, 5, 6, 7, 1, 0]
    manager.free("b")
    assert manager.free_gpu_slots() == [3, 2, 4, 5, 6, 7, 1, 0]
    manager.check_invariants()


def test_freed_blocks_stay_findable_and_are_hit():
    manager = make_manager()
    manager.allocate("a", 8)
    manager.commit("a", [h("a0"), h("a1")])
    manager.free("a")
    assert manager.free_gpu_slots() == [2, 3, 4, 5, 6, 7, 1, 0]
    assert manager.find_cached_prefix([h("a0"), h("a1"), h("x")]) == [0, 1]
    assert manager.find_cached_prefix([h("a1")]) == [1]
    assert manager.find_cached_prefix([h("x"), h("a0")]) == []
    assert manager.allocate("b", 11, cached_blocks=[0, 1])
    assert manager.slot_table("b") == [0, 1, 2]
    assert ref_counts(manager) == [1, 1, 1, 0, 0, 0, 0, 0]
    assert manager.free_gpu_slots() == [3, 4, 5, 6, 7]
    manager.check_invariants()


def test_allocating_the_lru_head_evicts_its_hash():
    manager = make_manager(num_gpu_blocks=4)
    manager.allocate("a", 16)
    manager.commit("a", [h("a0"), h("a1"), h("a2"), h("a3")])
    manager.free("a")
    assert manager.free_gpu_slots() == [3, 2, 1, 0]
    assert manager.allocate("b", 4)
    assert manager.slot_table("b") == [3]
    assert block_in_slot(manager, 3).block_hash is None
    assert manager.num_cached_blocks == 3
    assert manager.find_cached_prefix([h("a3")]) == []
    assert manager.find_cached_prefix([h("a0"), h("a1"), h("a2"), h("a3")]) == [0, 1, 2]
    manager.check_invariants()


def test_two_requests_with_the_same_prefix_share_blocks():
    manager = make_manager()
    manager.allocate("a", 9)  # [0, 1, 2]
    manager.commit("a", [h("p0"), h("p1")])
    cached = manager.find_cached_prefix([h("p0"), h("p1")])
    assert manager.allocate("b", 10, cached_blocks=cached)
    assert manager.slot_table("b") == [0, 1, 3]
    assert ref_counts(manager)[:4] == [2, 2, 1, 1]
    manager.free("a")
    assert ref_counts(manager)[:4] == [1, 1, 0, 1]
    assert manager.free_gpu_slots() == [2, 4, 5, 6, 7]
    manager.free("b")
    assert manager.free_gpu_slots() == [3, 2, 4, 5, 6, 7, 1, 0]
    manager.check_invariants()


def test_a_lookup_counts_its_hits_and_goes_stale_with_the_next_allocation_or_release():
    manager = make_manager()
    manager.allocate("a", 9)
    manager.commit("a", [h("p0"), h("p1")])
    manager.free("a")  # p0, p1 cached, unreferenced
    prefix = manager.look_up([h("p0"), h("p1"), h("x")])
    assert prefix.block_ids == [0, 1] and (prefix.num_on_gpu, prefix.num_on_cpu, prefix.num_unreferenced) == (2, 0, 2)
    assert manager.look_up([h("p0"), h("p1")], 1).block_ids == [0]  # the first `count` hashes only
    assert manager.allocate("b", 10, prefix)
    assert manager.look_up([h("p0"), h("p1")]).num_unreferenced == 0  # b holds them now
    with pytest.raises(ValueError, match="look it up again"):
        manager.allocate("c", 8, prefix)  # taken before b's allocation
    stale = manager.look_up([h("p0")])
    manager.free("b")
    with pytest.raises(ValueError, match="look it up again"):
        manager.can_allocate("c", 4, stale)
    manager.check_invariants()


def test_allocate_is_all_or_nothing():
    manager = make_manager(num_gpu_blocks=4)
    manager.allocate("a", 8)
    manager.commit("a", [h("a0"), h("a1")])
    manager.free("a")
    manager.allocate("c", 4)  # takes block 2; free: [3, 1, 0]
    # 5 blocks: the 2 free hits leave only block 3 for the 3 new ones.
    assert not manager.can_allocate("b", 20, cached_blocks=[0, 1])
    assert not manager.allocate("b", 20, cached_blocks=[0, 1])
    assert manager.slot_table("b") == []
    assert manager.free_gpu_slots() == [3, 1, 0]
    assert ref_counts(manager) == [0, 0, 1, 0]
    assert manager.find_cached_prefix([h("a0"), h("a1")]) == [0, 1]
    assert not manager.allocate("c", 20)
    assert manager.slot_table("c") == [2]
    assert manager.allocate("b", 12, cached_blocks=[0, 1])
    assert manager.slot_table("b") == [0, 1, 3]
    assert manager.free_gpu_slots() == []
    manager.check_invariants()


def test_commit_keeps_the_existing_block_for_a_known_hash():
    manager = make_manager()
    manager.allocate("a", 4)
    manager.allocate("b", 4)
    manager.commit("a", [h("x")])
    manager.commit("b", [h("x")])
    assert manager.find_cached_prefix([h("x")]) == [0]
    assert manager.block_ids("b") == [1] and manager.blocks[1].block_hash is None
    manager.free("b")
    assert manager.free_gpu_slots()[0] == 1
    manager.check_invariants()


def test_commit_registers_only_new_blocks_and_rejects_too_many_hashes():
    manager = make_manager()
    manager.allocate("a", 8)
    manager.commit("a", [h("a0")])
    manager.commit("a", [h("other"), h("a1")])  # block 0 was committed already
    assert manager.find_cached_prefix([h("a0"), h("a1")]) == [0, 1]
    assert manager.find_cached_prefix([h("other")]) == []
    with pytest.raises(ValueError):
        manager.commit("a", [h("a0"), h("a1"), h("a2")])


def test_cached_blocks_are_taken_only_at_first_allocation_and_must_still_be_cached():
    manager = make_manager(num_gpu_blocks=2)
    manager.allocate("a", 4)
    manager.commit("a", [h("a0")])
    manager.free("a")
    cached = manager.find_cached_prefix([h("a0")])
    manager.allocate("b", 4)
    with pytest.raises(ValueError):
        manager.allocate("b", 8, cached_blocks=cached)
    manager.allocate("c", 4)  # evicts block 0
    with pytest.raises(ValueError):
        manager.allocate("d", 8, cached_blocks=cached)
    manager.check_invariants()


def test_reset_prefix_cache_is_refused_while_blocks_are_in_use():
    manager = make_manager()
    manager.allocate("a", 8)
    manager.commit("a", [h("a0"), h("a1")])
    assert not manager.reset_prefix_cache()
    assert manager.find_cached_prefix([h("a0")]) == [0]
    manager.free("a")
    assert manager.reset_prefix_cache()
    assert manager.find_cached_prefix([h("a0")]) == []
    assert manager.num_cached_blocks == 0
    assert all(block.block_hash is None for block in manager.blocks)
    manager.check_invariants()


def test_with_prefix_caching_off_nothing_is_cached():
    manager = make_manager(enable_prefix_caching=False)
    manager.allocate("a", 8)
    manager.commit("a", [h("a0"), h("a1")])
    manager.free("a")
    assert manager.find_cached_prefix([h("a0")]) == []
    assert manager.num_cached_blocks == 0
    assert manager.free_gpu_slots() == [0, 1, 2, 3, 4, 5, 6, 7]
    manager.check_invariants()


def test_after_a_reset_blocks_sit_in_slots_other_than_their_ids():
    manager = make_manager(num_gpu_blocks=4)
    manager.allocate("a", 16)
    manager.commit("a", [h("a0"), h("a1"), h("a2"), h("a3")])
    manager.free("a")
    assert manager.reset_prefix_cache()
    # The cached slots keep their LRU order behind the free ones; their blocks go back to the
    # pool last-evicted first, so slots and block ids are handed out in different orders.
    assert manager.free_gpu_slots() == [3, 2, 1, 0]
    assert manager.allocate("b", 8)
    assert manager.slot_table("b") == [3, 2]
    assert manager.block_ids("b") == [0, 1]
    manager.commit("b", [h("b0"), h("b1")])
    manager.free("b")
    assert manager.free_gpu_slots() == [1, 0, 2, 3]
    assert manager.find_cached_prefix([h("b0"), h("b1")]) == [0, 1]  # block ids, not slots
    assert manager.allocate("c", 12, cached_blocks=[0, 1])
    assert manager.slot_table("c") == [3, 2, 1]
    assert manager.block_ids("c") == [0, 1, 2]
    assert ref_counts(manager) == [0, 1, 1, 1]
    assert manager.free_gpu_slots() == [0]
    manager.check_invariants()


def test_an_evicted_block_gives_its_slot_to_the_new_block_and_leaves_the_cache():
    manager = make_manager(num_gpu_blocks=4)
    manager.allocate("a", 16)
    manager.commit("a", [h("a0"), h("a1"), h("a2"), h("a3")])
    manager.free("a")
    assert manager.reset_prefix_cache()
    manager.allocate("b", 16)  # blocks 0..3 in slots 3..0
    manager.commit("b", [h("b0"), h("b1"), h("b2"), h("b3")])
    manager.free("b")
    assert manager.free_gpu_slots() == [0, 1, 2, 3]  # the LRU: b3 in slot 0 goes first
    assert manager.allocate("c", 6)
    assert manager.slot_table("c") == [0, 1]
    assert manager.block_ids("c") == [3, 2]  # the evicted blocks, reused with their slots
    assert manager.find_cached_prefix([h("b0"), h("b1"), h("b2"), h("b3")]) == [0, 1]
    assert [manager.blocks[i].gpu_slot for i in (0, 1)] == [3, 2]
    assert manager.num_cached_blocks == 2
    assert manager.num_free_blocks == 2 and manager.usage == 0.5
    manager.check_invariants()


def test_a_free_block_owns_no_slot_and_a_cached_one_keeps_its_slot():
    manager = make_manager(num_gpu_blocks=4)
    manager.allocate("a", 6)  # blocks 0, 1; only block 0 is full
    manager.commit("a", [h("a0")])
    manager.free("a")
    assert [(b.gpu_slot, b.cpu_slot, b.ref_count) for b in manager.blocks] == [
        (0, None, 0), (None, None, 0), (None, None, 0), (None, None, 0)]
    assert manager.free_gpu_slots() == [1, 2, 3, 0]
    assert manager.num_free_blocks == 4 and manager.num_cached_blocks == 1
    assert manager.usage == 0.0
    manager.check_invariants()
