"""Blocks another worker sent, taken in as cached ones (`BlockManager.adopt`), and the blocks a
producer may read out (`readable_prefix`: GPU slots, and CPU copies whose stores landed), on integers: which slots, in which LRU order, what a
lookup then finds, what is never taken, and the KV events and CPU-tier copies they cause."""

from __future__ import annotations

import pytest

from spillway.protocol.messages import BlockHash, KvEvents
from spillway.worker.core.block_manager import BlockManager
from spillway.worker.core.readable_prefix import ReadablePrefix
from spillway.worker.core.step_plan import NO_KV_COPIES, KVCopies


def h(name: str) -> BlockHash:
    return BlockHash(name.encode().ljust(16, b"."))


def hashes(*names: str) -> list[BlockHash]:
    return [h(name) for name in names]


def cached_request(manager: BlockManager, request_id: str, names: list[str]) -> None:
    """Blocks for `names` computed, committed and released into the cache."""
    assert manager.allocate(request_id, 4 * len(names))
    manager.commit(request_id, hashes(*names))
    manager.free(request_id)


def test_adopted_blocks_take_free_slots_and_are_cached_evictable_and_found():
    manager = BlockManager(8, 4)
    assert manager.adopt(hashes("a", "b", "c")) == [(h("a"), 0), (h("b"), 1), (h("c"), 2)]
    assert manager.num_free_blocks == 8 and manager.usage == 0.0
    assert manager.num_cached_blocks == 3
    # Free slots first, then the LRU from its head: the deepest block goes first, as when a
    # request releases its blocks.
    assert manager.free_gpu_slots() == [3, 4, 5, 6, 7, 2, 1, 0]
    assert manager.find_cached_prefix(hashes("a", "b", "c", "d")) == [0, 1, 2]
    manager.check_invariants()
    # A request on that prefix takes them as hits and computes only its own block.
    prefix = manager.look_up(hashes("a", "b", "c", "d"))
    assert manager.allocate("r", 16, prefix)
    assert manager.slot_table("r") == [0, 1, 2, 3]
    assert manager.num_free_blocks == 4
    manager.check_invariants()


def test_hashes_held_already_are_skipped_and_the_rest_of_the_chain_taken():
    manager = BlockManager(8, 4)
    cached_request(manager, "x", ["a", "b"])  # slots 0 and 1
    assert manager.adopt(hashes("a", "b", "c", "d")) == [(h("c"), 2), (h("d"), 3)]
    assert manager.find_cached_prefix(hashes("a", "b", "c", "d")) == [0, 1, 2, 3]
    assert manager.num_free_blocks == 8
    manager.check_invariants()


def test_adoption_evicts_from_the_lru_head_never_a_referenced_block_and_stops_without_a_slot():
    manager = BlockManager(4, 4)
    assert manager.allocate("running", 8)  # slots 0, 1: referenced
    assert manager.adopt(hashes("a", "b")) == [(h("a"), 2), (h("b"), 3)]
    assert manager.free_gpu_slots() == [3, 2]  # b is evicted first
    # Two slots can be had (b's, then a's); the third block finds none: the call's own blocks
    # are never evicted for it.
    assert manager.adopt(hashes("c", "d", "e")) == [(h("c"), 3), (h("d"), 2)]
    assert manager.find_cached_prefix(hashes("a")) == [] and manager.find_cached_prefix(hashes("b")) == []
    assert manager.find_cached_prefix(hashes("c", "d", "e")) == [3, 2]  # block ids: b's and a's, reused
    assert manager.free_gpu_slots() == [2, 3]
    assert manager.slot_table("running") == [0, 1] and manager.num_free_blocks == 2
    manager.check_invariants()
    assert manager.allocate("full", 8)  # evicts d, then c
    assert manager.adopt(hashes("f")) == []
    manager.check_invariants()


def test_an_adoption_invalidates_a_lookup_made_before_it():
    manager = BlockManager(2, 4)
    cached_request(manager, "x", ["a", "b"])
    prefix = manager.look_up(hashes("a", "b"))
    assert manager.adopt(hashes("c")) == [(h("c"), 1)]  # took b's slot
    with pytest.raises(ValueError, match="looked up before the cache last changed"):
        manager.allocate("y", 8, prefix)


def test_adopted_hashes_are_reported_stored_and_their_eviction_removed():
    manager = BlockManager(2, 4, kv_events=True)
    manager.adopt(hashes("a", "b"))
    assert manager.take_kv_events() == KvEvents(stored=hashes("a", "b"), removed=[])
    manager.adopt(hashes("c"))  # evicts b
    assert manager.take_kv_events() == KvEvents(stored=hashes("c"), removed=hashes("b"))


def test_without_prefix_caching_nothing_is_adopted():
    manager = BlockManager(4, 4, enable_prefix_caching=False)
    assert manager.adopt(hashes("a")) == []
    assert manager.num_cached_blocks == 0 and manager.free_gpu_slots() == [0, 1, 2, 3]


def test_with_a_cpu_tier_the_evicted_block_is_written_back_before_its_slot_is_reused():
    manager = BlockManager(2, 4, num_cpu_blocks=2)
    cached_request(manager, "x", ["a", "b"])
    assert manager.adopt(hashes("c")) == [(h("c"), 1)]
    # b's KV leaves slot 1 for the CPU tier first: these copies run before c's KV is written.
    assert manager.take_copies() == KVCopies(gpu_to_cpu=((1, 0),), store_batch=1)
    hits = manager.find_cached_prefix(hashes("a", "b"))
    assert [manager.on_gpu(block_id) for block_id in hits] == [True, False]
    manager.check_invariants()


def test_a_producer_reads_gpu_blocks_and_cpu_copies_whose_stores_landed_and_a_loading_block_from_the_cpu():
    manager = BlockManager(3, 4, num_cpu_blocks=4)
    cached_request(manager, "x", ["a", "b", "c"])
    on_gpu = ((0, 0), (1, 1))  # a and b: (GPU slot, position)
    assert manager.readable_prefix(hashes("a", "b", "c", "d")) == ReadablePrefix(3, on_gpu + ((2, 2),))
    assert manager.allocate("y", 4)  # evicts c (slot 2) to the CPU tier: its store is planned
    assert manager.readable_prefix(hashes("a", "b", "c")) == ReadablePrefix(2, on_gpu)
    assert manager.take_copies() == KVCopies(gpu_to_cpu=((2, 0),), store_batch=1)
    assert manager.readable_prefix(hashes("a", "b", "c")) == ReadablePrefix(2, on_gpu)  # on its way
    manager.stores_landed(1)
    assert manager.readable_prefix(hashes("a", "b", "c")) == ReadablePrefix(3, on_gpu, ((0, 2),))
    manager.free("y")
    # c comes back: its load is planned, then taken, and lands later; meanwhile its CPU copy,
    # complete and held for the load, is what is read.
    assert manager.allocate("z", 12, manager.look_up(hashes("a", "b", "c")))
    assert manager.readable_prefix(hashes("a", "b", "c")) == ReadablePrefix(3, on_gpu, ((0, 2),))
    assert manager.take_copies() is not NO_KV_COPIES
    assert manager.readable_prefix(hashes("a", "b", "c")) == ReadablePrefix(3, on_gpu, ((0, 2),))
    manager.loads_landed()
    assert manager.readable_prefix(hashes("a", "b", "c")) == ReadablePrefix(3, on_gpu + ((2, 2),))
    manager.check_invariants()


def test_a_block_whose_store_is_not_known_landed_ends_the_prefix_even_in_a_slot_written_before():
    """The tier's state forced: c's and then d's stores into the one CPU slot, d's taken after
    c's landed; d is not served until its own batch lands, and neither is anything after it."""
    manager = BlockManager(2, 4, num_cpu_blocks=1)
    cached_request(manager, "x", ["c"])
    assert manager.allocate("y", 8)  # evicts c into CPU slot 0 (batch 1)
    assert manager.take_copies() == KVCopies(gpu_to_cpu=((0, 0),), store_batch=1)
    manager.stores_landed(1)
    assert manager.readable_prefix(hashes("c")) == ReadablePrefix(1, (), ((0, 0),))
    manager.commit("y", hashes("d", "e"))
    manager.free("y")  # d (GPU slot 1) and e (GPU slot 0) cached; e evicted first
    assert manager.allocate("z", 4)  # evicts e: its store takes c's CPU slot, and c is dropped
    assert manager.take_copies() == KVCopies(gpu_to_cpu=((0, 0),), store_batch=2)
    assert manager.find_cached_prefix(hashes("c")) == []
    assert manager.readable_prefix(hashes("d", "e")) == ReadablePrefix(1, ((1, 0),))
    manager.stores_landed(2)
    assert manager.readable_prefix(hashes("d", "e")) == ReadablePrefix(2, ((1, 0),), ((0, 1),))
    manager.check_invariants()


def test_a_block_written_back_ahead_is_served_from_the_cpu_only_once_that_store_landed():
    manager = BlockManager(2, 4, num_cpu_blocks=4)
    cached_request(manager, "x", ["a", "b"])  # LRU: b (slot 1), then a (slot 0)
    assert manager.write_back_ahead(max_blocks=2, max_scan=2) == 2
    assert manager.take_copies() == KVCopies(ahead_to_cpu=((0, 0), (1, 1)), store_batch=1)
    assert manager.allocate("y", 8)  # evicts both: no store, their copies are on their way
    assert manager.take_copies().wait_for_ahead
    assert manager.readable_prefix(hashes("a", "b")) == ReadablePrefix()
    manager.stores_landed(1)
    assert manager.readable_prefix(hashes("a", "b")) == ReadablePrefix(2, (), ((0, 0), (1, 1)))
    with pytest.raises(AssertionError, match="store batch 2 of 1 taken"):
        manager.stores_landed(2)
    manager.check_invariants()


def test_without_a_tier_a_producer_reads_the_gpu_run_only():
    manager = BlockManager(2, 4)
    cached_request(manager, "x", ["a", "b"])
    assert manager.readable_prefix(hashes("a", "b", "c")) == ReadablePrefix(2, ((0, 0), (1, 1)))
    assert manager.allocate("y", 4)  # evicts b: dropped
    assert manager.readable_prefix(hashes("a", "b")) == ReadablePrefix(1, ((0, 0),))

