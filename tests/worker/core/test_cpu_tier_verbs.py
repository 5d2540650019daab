"""The tier's verbs (worker/core/tier.py) on integers: the CPU tier driven alone, and the null
tier of a block manager without one, which gives the block ids a tier-less cache always gave."""

from __future__ import annotations

import pytest

from spillway.protocol.messages import BlockHash
from spillway.worker.core.block_lru import Block
from spillway.worker.core.block_manager import BlockManager
from spillway.worker.core.cpu_slots import CpuTier
from spillway.worker.core.step_plan import NO_KV_COPIES, KVCopies
from spillway.worker.core.tier import KVTier, NullTier


def h(name: str) -> BlockHash:
    return BlockHash(name.encode().ljust(16, b"."))


def cached_block(block_id: int, gpu_slot: int | None) -> Block:
    return Block(block_id=block_id, gpu_slot=gpu_slot, block_hash=h(f"b{block_id}"))


def cached_request(manager: BlockManager, request_id: str, names: list[str]) -> None:
    """Blocks for `names` computed, committed and released into the cache."""
    assert manager.allocate(request_id, 4 * len(names))
    manager.commit(request_id, [h(name) for name in names])
    manager.free(request_id)


def test_a_manager_without_a_tier_has_the_null_tier_and_both_tiers_answer_every_verb():
    without, with_tier = BlockManager(4, 4), BlockManager(4, 4, num_cpu_blocks=2)
    assert type(without.tier) is NullTier and type(with_tier.tier) is CpuTier
    assert isinstance(without.tier, KVTier) and isinstance(with_tier.tier, KVTier)


def test_without_a_tier_an_evicted_block_is_dropped_and_its_id_taken_again():
    manager = BlockManager(4, 4)
    cached_request(manager, "a", ["a0", "a1", "a2", "a3"])
    assert manager.allocate("b", 8)  # evicts a3 then a2: nothing keeps them
    assert manager.slot_table("b") == [3, 2] and manager.block_ids("b") == [3, 2]
    assert manager.take_copies() is NO_KV_COPIES
    assert manager.find_cached_prefix([h("a0"), h("a1"), h("a2"), h("a3")]) == [0, 1]
    assert manager.num_cached_blocks == 2 and manager.cpu_usage == 0.0
    assert manager.write_back_ahead(max_blocks=4, max_scan=16) == 0
    assert manager.awaited_load_batch("b") == 0
    manager.loads_landed()
    manager.wait_for_loads_this_step()
    assert manager.take_copies() is NO_KV_COPIES
    manager.check_invariants()


def test_with_a_tier_the_same_evictions_take_the_same_gpu_slots_and_keep_the_blocks():
    manager = BlockManager(4, 4, num_cpu_blocks=4)
    cached_request(manager, "a", ["a0", "a1", "a2", "a3"])
    assert manager.allocate("b", 8)
    assert manager.slot_table("b") == [3, 2] and manager.block_ids("b") == [4, 5]
    assert manager.take_copies() == KVCopies(gpu_to_cpu=((3, 0), (2, 1)), store_batch=1)
    assert manager.find_cached_prefix([h("a0"), h("a1"), h("a2"), h("a3")]) == [0, 1, 2, 3]


def test_the_null_tier_refuses_a_load_and_a_forget_and_its_invariants_see_any_copy():
    tier = NullTier()
    with pytest.raises(AssertionError, match="holds no block"):
        tier.prepare_load([cached_block(0, None)], lambda: 0)
    assert tier.prepare_load([], lambda: 0) == 0
    with pytest.raises(AssertionError, match="no copy to forget"):
        tier.forget(cached_block(0, 1))
    manager = BlockManager(4, 4)
    cached_request(manager, "a", ["a0"])
    manager.blocks[0].load_batch = 1
    with pytest.raises(AssertionError, match="without a CPU tier"):
        manager.check_invariants()


def test_a_load_pins_its_copies_before_taking_gpu_slots_so_the_evictions_it_causes_cannot_reach_them():
    dropped = []
    tier = CpuTier(1, dropped.append)
    on_cpu = cached_block(0, 5)
    assert tier.prepare_store(on_cpu, gpu_slot=5)  # written back at its eviction: CPU slot 0
    on_cpu.gpu_slot = None
    assert tier.take_copies() == KVCopies(gpu_to_cpu=((5, 0),), store_batch=1)
    evicted = cached_block(1, 7)

    def take_gpu_slot() -> int:
        """The slot of the GPU LRU's head, written back first: the tier's one slot is pinned."""
        tier.evicted(evicted)
        assert not tier.prepare_store(evicted, 7)
        return 7

    assert tier.prepare_load([on_cpu], take_gpu_slot) == 1
    assert (on_cpu.cpu_slot, on_cpu.gpu_slot, on_cpu.load_batch) == (0, 7, 1)
    assert evicted.cpu_slot is None and dropped == []
    assert tier.take_copies() == KVCopies(cpu_to_gpu=((0, 7),), load_batch=1, load_batch_ends=((1, 1),))
    assert (tier.num_loading, tier.landed_through) == (1, 0)
    tier.complete_load(1)
    assert (tier.num_loading, tier.landed_through, on_cpu.load_batch) == (0, 1, 0)
    tier.check_invariants([on_cpu, evicted], _raise_unless)


def test_stores_ahead_are_pending_until_completed():
    tier = CpuTier(4, lambda block: None)
    gpu_lru = [cached_block(0, 2), cached_block(1, 0), cached_block(2, 1)]
    assert tier.prepare_store_ahead(gpu_lru, max_blocks=2, max_scan=8) == 2
    assert tier.take_copies() == KVCopies(ahead_to_cpu=((0, 0), (2, 1)), store_batch=1)  # CPU slots in GPU-slot order
    assert tier.num_ahead_pending == 2 and tier.usage == 0.5
    assert tier.prepare_store_ahead(gpu_lru, max_blocks=2, max_scan=8) == 0  # one batch at a time
    tier.complete_store()
    assert tier.num_ahead_pending == 0
    assert tier.prepare_store_ahead(gpu_lru, max_blocks=2, max_scan=8) == 1  # the one without a copy
    assert tier.take_copies() == KVCopies(ahead_to_cpu=((1, 2),), store_batch=2)


def _raise_unless(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)
