"""The block manager with a CPU tier: write-back, loads, pins and a full tier, on integers."""

from __future__ import annotations

import pytest

from spillway.protocol.messages import BlockHash
from spillway.worker.core.block_manager import BlockManager
from spillway.worker.kv_tier.block_copies import block_runs
from spillway.worker.core.step_plan import NO_KV_COPIES, KVCopies


def h(name: str) -> BlockHash:
    return BlockHash(name.encode().ljust(16, b"."))


def cached_request(manager: BlockManager, request_id: str, names: list[str]) -> None:
    """Blocks for `names` computed, committed and released into the cache."""
    assert manager.allocate(request_id, 4 * len(names))
    manager.commit(request_id, [h(name) for name in names])
    manager.free(request_id)


def test_an_evicted_cached_block_is_written_back_and_still_found():
    manager = BlockManager(4, 4, True, num_cpu_blocks=4)
    cached_request(manager, "a", ["a0", "a1", "a2", "a3"])
    assert manager.take_copies() is NO_KV_COPIES
    assert manager.allocate("b", 8)  # evicts a3 then a2 (the LRU head is the last block)
    assert manager.slot_table("b") == [3, 2]
    assert manager.take_copies() == KVCopies(gpu_to_cpu=((3, 0), (2, 1)), store_batch=1)
    hits = manager.find_cached_prefix([h("a0"), h("a1"), h("a2"), h("a3")])
    assert hits == [0, 1, 2, 3]
    assert [manager.on_gpu(block_id) for block_id in hits] == [True, True, False, False]
    assert manager.cpu_usage == 0.5
    manager.check_invariants()


def test_a_cpu_hit_is_loaded_once_and_shared_by_every_request_that_needs_it():
    manager = BlockManager(4, 4, True, num_cpu_blocks=4)
    cached_request(manager, "a", ["a0", "a1", "a2", "a3"])
    manager.allocate("b", 8)
    manager.take_copies()
    manager.free("b")  # unhashed: slots 3 and 2 are free again
    hashes = [h("a0"), h("a1"), h("a2"), h("a3")]
    assert manager.allocate("c", 16, manager.find_cached_prefix(hashes))
    assert manager.slot_table("c") == [0, 1, 3, 2]
    assert manager.awaited_load_batch("c") == 1  # the loads this step's copies take
    # A second request finds the blocks on the GPU already, and waits for the same loads.
    hits = manager.find_cached_prefix(hashes)
    assert all(map(manager.on_gpu, hits))
    assert manager.allocate("d", 16, hits)
    assert manager.awaited_load_batch("d") == 1
    manager.check_invariants()
    # a2 was stored to CPU slot 1, a3 to CPU slot 0: loaded in CPU-slot order into the GPU
    # slots taken (3 and 2) in ascending order, one run (a3 -> 2, a2 -> 3).
    assert manager.take_copies() == KVCopies(cpu_to_gpu=((0, 2), (1, 3)), load_batch=1, load_batch_ends=((1, 2),))
    assert manager.awaited_load_batch("c") == manager.awaited_load_batch("d") == 1  # on their way
    manager.loads_landed(0)
    assert manager.awaited_load_batch("c") == 1
    manager.loads_landed(1)
    assert manager.awaited_load_batch("c") == manager.awaited_load_batch("d") == 0
    manager.free("c")
    manager.free("d")
    manager.check_invariants()


def loaded_in_two_batches() -> BlockManager:
    """Blocks a2, a3 on the CPU only; c takes a3's load in batch 1, d a2's in batch 2."""
    manager = BlockManager(4, 4, True, num_cpu_blocks=4)
    cached_request(manager, "a", ["a0", "a1", "a2", "a3"])
    manager.allocate("b", 8)
    manager.take_copies()
    manager.free("b")
    assert manager.allocate("c", 4, manager.find_cached_prefix([h("a3")])) is True
    assert manager.take_copies().load_batch == 1
    assert manager.allocate("d", 4, manager.find_cached_prefix([h("a2")])) is True
    assert manager.take_copies().load_batch == 2
    return manager


def test_each_load_batch_lands_on_its_own_and_frees_only_its_requests():
    manager = loaded_in_two_batches()
    assert (manager.awaited_load_batch("c"), manager.awaited_load_batch("d")) == (1, 2)
    manager.loads_landed(1)  # batch 2 still on its way
    assert (manager.awaited_load_batch("c"), manager.awaited_load_batch("d")) == (0, 2)
    manager.loads_landed()
    assert manager.awaited_load_batch("d") == 0 and manager.tier.num_loading == 0


def test_a_step_reusing_the_slot_of_a_block_still_loading_waits_for_the_loads():
    manager = loaded_in_two_batches()
    manager.free("c")  # gone before its load landed: a3 is cached, its GPU slot evictable
    manager.free("d")
    assert manager.allocate("e", 16)  # every slot: a3's and a2's, their loads still running
    copies = manager.take_copies()
    assert copies.wait_for_loads and copies.load_batch == 0
    manager.check_invariants()
    manager.loads_landed()
    manager.free("e")
    assert manager.allocate("f", 16)  # the same slots again, nothing loading now
    assert not manager.take_copies().wait_for_loads


def test_a_full_cpu_tier_evicts_its_least_recently_stored_copy_and_drops_what_does_not_fit():
    manager = BlockManager(4, 4, True, num_cpu_blocks=2)
    cached_request(manager, "a", ["a0", "a1", "a2", "a3"])
    assert manager.allocate("b", 12)  # evicts a3, a2, a1: the third finds every CPU slot in use by this step
    assert manager.take_copies() == KVCopies(gpu_to_cpu=((3, 0), (2, 1)), store_batch=1)
    assert manager.find_cached_prefix([h("a0"), h("a1"), h("a2")]) == [0]
    assert manager.num_cached_blocks == 3  # a0 on the GPU, a2 and a3 on the CPU
    manager.free("b")
    manager.check_invariants()
    assert manager.allocate("e", 16)  # three free slots, then a0 is evicted: a3's CPU copy makes room
    assert manager.take_copies() == KVCopies(gpu_to_cpu=((0, 0),), store_batch=2)
    assert manager.find_cached_prefix([h("a3")]) == []
    assert manager.find_cached_prefix([h("a0")]) == [0]
    assert manager.find_cached_prefix([h("a0"), h("a1")]) == [0]
    assert manager.num_cached_blocks == 2
    assert manager.cpu_usage == 1.0
    manager.check_invariants()


def test_cpu_hits_are_pinned_from_lookup_until_their_load_is_planned():
    manager = BlockManager(2, 4, True, num_cpu_blocks=2)
    cached_request(manager, "a", ["a0", "a1"])
    cached_request(manager, "b", ["b0", "b1"])  # evicts a1 (CPU slot 0) and a0 (CPU slot 1)
    assert manager.take_copies() == KVCopies(gpu_to_cpu=((1, 0), (0, 1)), store_batch=1)
    hits = manager.find_cached_prefix([h("a0"), h("a1")])
    assert hits == [0, 1]
    # Each load takes a GPU slot by evicting a b block, whose write-back would need a CPU slot:
    # the only ones hold the pinned hits, so the b blocks are dropped instead.
    assert manager.allocate("c", 8, hits)
    assert manager.take_copies() == KVCopies(cpu_to_gpu=((0, 0), (1, 1)), load_batch=1, load_batch_ends=((1, 2),))
    assert manager.slot_table("c") == [1, 0]  # a0 (CPU slot 1) -> GPU slot 1, a1 (CPU slot 0) -> 0
    assert manager.find_cached_prefix([h("b0")]) == []
    assert manager.num_cached_blocks == 2
    manager.check_invariants()


def test_reset_forgets_the_cpu_copies_too():
    manager = BlockManager(2, 4, True, num_cpu_blocks=2)
    cached_request(manager, "a", ["a0", "a1"])
    cached_request(manager, "b", ["b0", "b1"])
    manager.take_copies()
    assert manager.reset_prefix_cache()
    assert manager.num_cached_blocks == 0 and manager.cpu_usage == 0.0
    assert manager.find_cached_prefix([h("a0")]) == []
    manager.check_invariants()


def test_a_cpu_copy_that_disagrees_with_its_block_breaks_the_invariants():
    manager = BlockManager(2, 4, True, num_cpu_blocks=2)
    cached_request(manager, "a", ["a0", "a1"])
    cached_request(manager, "b", ["b0", "b1"])
    manager.take_copies()
    manager.tier.slot_hashes[0] = h("other")
    with pytest.raises(AssertionError, match="holds another block's KV"):
        manager.check_invariants()


def test_the_tier_needs_prefix_caching():
    with pytest.raises(ValueError, match="needs prefix caching"):
        BlockManager(4, 4, False, num_cpu_blocks=4)


def test_cached_blocks_are_written_back_ahead_from_the_lru_head_into_free_cpu_slots():
    manager = BlockManager(4, 4, True, num_cpu_blocks=3)
    cached_request(manager, "a", ["a0", "a1", "a2", "a3"])  # LRU head first: a3, a2, a1, a0
    assert manager.write_back_ahead(max_blocks=2, max_scan=8) == 2  # a3 and a2, in GPU-slot order
    assert manager.take_copies() == KVCopies(ahead_to_cpu=((2, 0), (3, 1)), store_batch=1)
    manager.check_invariants()
    # One batch at a time: nothing more until the device says the first one finished.
    assert manager.write_back_ahead(max_blocks=2, max_scan=8) == 0
    manager.tier.complete_store()
    assert manager.write_back_ahead(max_blocks=1, max_scan=8) == 1  # a1 into the last free slot
    assert manager.take_copies() == KVCopies(ahead_to_cpu=((1, 2),), store_batch=2)
    # Evicting the blocks written back ahead needs no store; their CPU copies still serve hits.
    assert manager.allocate("b", 8)
    assert manager.slot_table("b") == [3, 2]
    assert manager.take_copies() is NO_KV_COPIES
    hits = manager.find_cached_prefix([h("a0"), h("a1"), h("a2"), h("a3")])
    assert hits == [0, 1, 2, 3] and [manager.on_gpu(i) for i in hits] == [True, True, False, False]
    manager.check_invariants()


def test_a_step_that_reuses_a_slot_whose_ahead_store_may_still_run_waits_for_it():
    manager = BlockManager(4, 4, True, num_cpu_blocks=4)
    cached_request(manager, "a", ["a0", "a1", "a2", "a3"])
    manager.write_back_ahead(max_blocks=1, max_scan=4)
    assert manager.take_copies() == KVCopies(ahead_to_cpu=((3, 0),), store_batch=1)
    assert manager.allocate("b", 4)  # takes a3's slot while its store may be on its way
    copies = manager.take_copies()
    assert copies.wait_for_ahead and not copies.gpu_to_cpu
    # Once waited for (or reported finished), a reuse waits no more.
    assert manager.allocate("c", 4)  # evicts a2, stored now, normally
    assert manager.take_copies() == KVCopies(gpu_to_cpu=((2, 1),), store_batch=2)


def test_a_full_tier_writes_back_ahead_into_its_oldest_copies_so_the_eviction_stores_nothing():
    manager = BlockManager(2, 4, True, num_cpu_blocks=2)
    cached_request(manager, "a", ["a0", "a1"])
    assert manager.allocate("b", 8)  # both evicted and written back: the tier is full
    manager.take_copies()
    manager.commit("b", [h("b0"), h("b1")])
    manager.free("b")
    stale = manager.look_up([h("a0"), h("a1")])
    assert len(stale) == 2 and stale.num_on_cpu == 2
    # No free GPU slot: the next allocation evicts b's blocks, so they take a's CPU slots now,
    # as the store at their eviction would, and a is gone from the cache.
    assert manager.write_back_ahead(max_blocks=2, max_scan=2) == 2
    assert manager.take_copies() == KVCopies(ahead_to_cpu=((0, 0), (1, 1)), store_batch=2)
    assert manager.find_cached_prefix([h("a0"), h("a1")]) == []
    with pytest.raises(ValueError, match="looked up before"):  # a lookup made before the drop is refused
        manager.allocate("late", 8, stale)
    manager.tier.complete_store()
    assert manager.allocate("c", 8)  # evicts b0 and b1: their copies exist, nothing to store
    assert not manager.take_copies().gpu_to_cpu
    hits = manager.find_cached_prefix([h("b0"), h("b1")])
    assert len(hits) == 2 and not any(map(manager.on_gpu, hits))
    manager.check_invariants()


def test_a_full_tier_keeps_its_copies_while_the_gpu_has_slots_to_spare():
    manager = BlockManager(4, 4, True, num_cpu_blocks=2)
    cached_request(manager, "a", ["a0", "a1"])
    assert manager.allocate("b", 16)  # two free slots and a's two, written back: the tier is full
    manager.take_copies()
    manager.commit("b", [h("b0"), h("b1")])
    manager.free("b")  # b2, b3 unhashed: two free GPU slots; b0, b1 cached
    # The next two allocations take the free slots: an LRU head 2 deep is not reached by them.
    assert manager.write_back_ahead(max_blocks=2, max_scan=2) == 0
    assert manager.find_cached_prefix([h("a0"), h("a1")]) == [0, 1]
    assert manager.write_back_ahead(max_blocks=2, max_scan=4) == 2  # 4 deep: it is
    assert manager.find_cached_prefix([h("a0"), h("a1")]) == []
    manager.check_invariants()


def test_write_back_ahead_never_replaces_the_copy_of_a_block_still_on_the_gpu():
    manager = BlockManager(3, 4, True, num_cpu_blocks=2)
    cached_request(manager, "a", ["a0", "a1", "a2"])  # LRU head first: a2, a1, a0
    assert manager.write_back_ahead(max_blocks=3, max_scan=3) == 2  # a2 and a1 fill the tier
    manager.take_copies()
    manager.tier.complete_store()
    # a0 would replace a2's or a1's copy, then that block the other's: a ring of stores.
    assert manager.write_back_ahead(max_blocks=3, max_scan=3) == 0
    assert manager.take_copies() is NO_KV_COPIES
    assert sum(manager.blocks[i].cpu_slot is not None for i in manager.find_cached_prefix([h("a0"), h("a1"), h("a2")])) == 2
    manager.check_invariants()


def test_a_prefix_written_back_ahead_stores_and_reloads_in_one_run_each():
    """Eight cached blocks, the LRU head their last: written back ahead in GPU-slot order into
    consecutive CPU slots, pushed out, then reloaded in CPU-slot order into the GPU slots
    taken, ascending: one copy each way, not eight."""
    manager = BlockManager(8, 4, True, num_cpu_blocks=16)
    names = [f"p{i}" for i in range(8)]
    cached_request(manager, "p", names)
    assert manager.write_back_ahead(max_blocks=8, max_scan=8) == 8
    stores = manager.take_copies().ahead_to_cpu
    assert stores == tuple((slot, slot) for slot in range(8))
    assert block_runs(stores) == [(0, 0, 8)]
    manager.tier.complete_store()
    cached_request(manager, "filler", [f"f{i}" for i in range(8)])  # takes every GPU slot
    manager.take_copies()  # the filler's write-back
    hits = manager.find_cached_prefix([h(name) for name in names])
    assert hits and not any(map(manager.on_gpu, hits))
    assert manager.allocate("q", 32, hits)
    loads = manager.take_copies().cpu_to_gpu
    assert len(loads) == 8 and block_runs(loads) == [(0, 0, 8)]
    manager.check_invariants()
