"""A consumer of a worker's KV events, as a gateway routing by prefix replays them: a plain set,
checked against what the worker's block manager holds."""

from __future__ import annotations

from spillway.protocol.messages import KvEvents
from spillway.worker.core.block_manager import BlockManager


class KvEventsConsumer:
    def __init__(self) -> None:
        self.held: set[bytes] = set()
        self.num_reports = self.num_stored = self.num_removed = self.num_cleared = 0

    def apply(self, events: KvEvents | None) -> None:
        if events is None:
            return
        self.num_reports += 1
        self.num_stored += len(events.stored)
        self.num_removed += len(events.removed)
        if events.cleared:
            self.num_cleared += 1
            self.held = set()
        self.held |= set(events.stored)
        self.held -= set(events.removed)

    def take_from(self, manager: BlockManager) -> KvEvents | None:
        """Take the manager's report, apply it, and check the result against the cache."""
        events = manager.take_kv_events()
        self.apply(events)
        assert self.held == manager.held_block_hashes()
        return events
