"""KV events from the block manager: each report holds the net change of the hashes a lookup can
find since the report before, and a consumer that replays them holds exactly those hashes."""

from __future__ import annotations

from kv_events_consumer import KvEventsConsumer

from spillway.protocol.messages import BlockHash, KvEvents
from spillway.worker.core.block_manager import BlockManager
from spillway.worker.core.kv_events import KvEventLog


def h(name: str) -> BlockHash:
    return BlockHash(name.encode().ljust(16, b"."))


def hs(*names: str) -> list[BlockHash]:
    return [h(name) for name in names]


class Gateway:
    """A consumer of one manager's reports (kv_events_consumer.py)."""

    def __init__(self, manager: BlockManager) -> None:
        self.manager = manager
        self.consumer = KvEventsConsumer()

    @property
    def held(self) -> set[bytes]:
        return self.consumer.held

    def report(self) -> KvEvents | None:
        return self.consumer.take_from(self.manager)


def cached_request(manager: BlockManager, request_id: str, names: list[str]) -> None:
    """Blocks for `names` computed, committed and released into the cache (4 tokens a block)."""
    assert manager.allocate(request_id, 4 * len(names))
    manager.commit(request_id, hs(*names))
    manager.free(request_id)


def test_the_log_keeps_each_hashs_net_change_in_the_order_of_its_last_store():
    log = KvEventLog()
    assert log.take() is None
    log.stored(h("a"))
    log.stored(h("b"))
    log.removed(h("a"))  # stored and removed before a report: reported removed, harmless to a consumer
    log.removed(h("c"))
    log.stored(h("c"))  # removed and stored again: held
    assert log.take() == KvEvents(stored=hs("b", "c"), removed=hs("a"))
    assert log.take() is None
    log.removed(h("x"))
    log.cleared()
    log.stored(h("y"))
    log.stored(h("z"))
    log.removed(h("z"))  # after a clear the consumer starts from nothing: no removal needed
    assert log.take() == KvEvents(stored=hs("y"), removed=[], cleared=True)
    assert log.take() is None


def test_blocks_filled_by_a_prompt_are_reported_once_when_committed():
    manager = BlockManager(8, 4, kv_events=True)
    gateway = Gateway(manager)
    assert manager.allocate("a", 10)
    assert gateway.report() is None  # allocated, not computed: nothing a lookup finds yet
    manager.commit("a", hs("a0"))
    manager.commit("a", hs("a0", "a1"))  # the next chunk completes a second block
    assert gateway.report() == KvEvents(stored=hs("a0", "a1"), removed=[])
    manager.free("a")  # cached: still held
    assert gateway.report() is None
    assert gateway.held == set(hs("a0", "a1"))


def test_a_shared_prefix_is_reported_once_and_a_duplicate_block_not_at_all():
    manager = BlockManager(8, 4, kv_events=True)
    gateway = Gateway(manager)
    cached_request(manager, "a", ["a0", "a1"])
    gateway.report()
    hits = manager.look_up(hs("a0", "a1", "b2"))
    assert manager.allocate("b", 12, hits)
    manager.commit("b", hs("a0", "a1", "b2"))
    # "c" computed a0 again in a block of its own (it looked up before "a" committed): the
    # cache keeps a's block, c's stays unhashed, nothing changes for the gateway.
    assert manager.allocate("c", 4)
    manager.commit("c", hs("a0"))
    assert gateway.report() == KvEvents(stored=hs("b2"), removed=[])


def test_evictions_without_a_tier_remove_the_hashes_last_block_first():
    manager = BlockManager(4, 4, kv_events=True)
    gateway = Gateway(manager)
    cached_request(manager, "a", ["a0", "a1", "a2", "a3"])
    gateway.report()
    assert manager.allocate("b", 8)  # the LRU head is a's last block
    assert gateway.report() == KvEvents(stored=[], removed=hs("a3", "a2"))
    assert gateway.held == set(hs("a0", "a1"))


def test_a_block_stored_and_evicted_between_two_reports_ends_up_not_held():
    manager = BlockManager(4, 4, kv_events=True)
    gateway = Gateway(manager)
    cached_request(manager, "a", ["a0", "a1", "a2", "a3"])
    assert manager.allocate("b", 8)
    manager.commit("b", hs("a3"))  # b's first block recomputes a3: stored again, in another block
    assert gateway.report() == KvEvents(stored=hs("a0", "a1", "a3"), removed=hs("a2"))


def test_moves_between_the_tiers_are_no_events_and_a_dropped_cpu_copy_is():
    manager = BlockManager(4, 4, True, num_cpu_blocks=2, kv_events=True)
    gateway = Gateway(manager)
    cached_request(manager, "a", ["a0", "a1", "a2", "a3"])
    assert gateway.report() == KvEvents(stored=hs("a0", "a1", "a2", "a3"), removed=[])
    assert manager.allocate("b", 8)  # evicts a3 and a2 from the GPU: written back, still held
    assert manager.take_copies().gpu_to_cpu == ((3, 0), (2, 1))
    assert gateway.report() is None
    assert [manager.on_gpu(block_id) for block_id in manager.find_cached_prefix(hs("a0", "a1", "a2", "a3"))] \
        == [True, True, False, False]
    manager.free("b")  # unhashed: its slots are free again
    hits = manager.look_up(hs("a0", "a1", "a2", "a3"))
    assert manager.allocate("c", 16, hits)  # found again, loaded back from the CPU
    assert len(manager.take_copies().cpu_to_gpu) == 2
    manager.loads_landed()
    assert gateway.report() is None
    manager.free("c")
    # Evicts all four: a3 and a2 have their CPU copies, a1 and a0 are written back over them,
    # and a3 and a2, then on the CPU only, are gone.
    assert manager.allocate("d", 16)
    assert manager.take_copies().gpu_to_cpu == ((1, 0), (0, 1))
    assert gateway.report() == KvEvents(stored=[], removed=hs("a3", "a2"))
    manager.commit("d", hs("d0", "d1", "d2", "d3"))
    manager.free("d")
    assert manager.allocate("e", 8)  # d3 and d2 are written back over a1's and a0's CPU copies
    manager.take_copies()
    assert gateway.report() == KvEvents(stored=hs("d0", "d1", "d2", "d3"), removed=hs("a1", "a0"))
    assert gateway.held == set(hs("d0", "d1", "d2", "d3"))
    manager.check_invariants()


def test_a_reset_clears_everything_reported_and_reports_what_follows():
    manager = BlockManager(4, 4, True, num_cpu_blocks=2, kv_events=True)
    gateway = Gateway(manager)
    cached_request(manager, "a", ["a0", "a1", "a2", "a3"])
    assert manager.allocate("b", 8)
    manager.take_copies()
    manager.free("b")
    gateway.report()
    assert gateway.held == set(hs("a0", "a1", "a2", "a3"))  # two of them on the CPU only
    assert manager.reset_prefix_cache()
    assert gateway.report() == KvEvents(stored=[], removed=[], cleared=True)
    assert gateway.held == set()
    cached_request(manager, "c", ["c0"])
    assert manager.reset_prefix_cache()
    cached_request(manager, "d", ["d0"])
    assert gateway.report() == KvEvents(stored=hs("d0"), removed=[], cleared=True)


def test_the_snapshot_lists_every_held_hash_in_store_order():
    manager = BlockManager(4, 4, True, num_cpu_blocks=2, kv_events=True)
    cached_request(manager, "a", ["a0", "a1", "a2", "a3"])
    assert manager.allocate("b", 8)  # a3 and a2 go to the CPU only
    manager.commit("b", hs("b0"))
    assert manager.kv_events_snapshot() == KvEvents(stored=hs("a0", "a1", "a2", "a3", "b0"), removed=[],
                                                    cleared=True)
    assert manager.held_block_hashes() == set(hs("a0", "a1", "a2", "a3", "b0"))


def test_without_kv_events_nothing_is_recorded():
    manager = BlockManager(4, 4, True, num_cpu_blocks=2)
    cached_request(manager, "a", ["a0", "a1", "a2", "a3"])
    assert manager.allocate("b", 16)  # evicts all four, drops two
    assert manager.reset_prefix_cache() is False
    manager.free("b")
    assert manager.reset_prefix_cache()
    assert manager.take_kv_events() is None
    assert manager._events is None  # no log to grow
