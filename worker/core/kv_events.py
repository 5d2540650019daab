"""The prefix blocks a worker holds, reported as changes (`KvEvents`, protocol/messages.py).

A gateway in front of several replicas routes a request to the one holding the longest run of
its prefix blocks, so each worker tells it which block hashes became findable and which stopped
being findable, never the whole set. A hash is held while the prefix cache maps it (on the GPU,
in the CPU tier, or both): the block manager records a store when `commit` registers a hash, a
removal when a block loses its hash (evicted with no CPU copy, or its CPU copy dropped while it
had no GPU slot), and a clear at `reset_prefix_cache`. A block moving between the tiers keeps
its hash, so nothing is recorded for it.

Between two reports only each hash's net change is kept, one entry per hash touched:

    stored(a) stored(b) removed(a)  ->  {b: held, a: not held}  ->  stored [b], removed [a]

so applying the reports in order (`replay`) to what a consumer held gives what is held now,
whether or not the consumer ever heard of `a`.
"""

from __future__ import annotations

from spillway.protocol.messages import BlockHash, KvEvents


class KvEventLog:
    """The net change of each hash since the last `take`, and whether the cache was reset."""

    __slots__ = ("_held", "_cleared")

    def __init__(self) -> None:
        self._held: dict[BlockHash, bool] = {}  # hash -> held now; in the order of the last store
        self._cleared = False

    def stored(self, block_hash: BlockHash) -> None:
        self._held.pop(block_hash, None)  # a hash stored again goes to the end: `stored` keeps store order
        self._held[block_hash] = True

    def removed(self, block_hash: BlockHash) -> None:
        self._held[block_hash] = False

    def cleared(self) -> None:
        self._held.clear()
        self._cleared = True

    def take(self) -> KvEvents | None:
        """The report of the changes since the last call (None: none), and start afresh."""
        if not self._held and not self._cleared:
            return None
        stored = [block_hash for block_hash, held in self._held.items() if held]
        # After a clear the consumer starts from nothing: a hash not held now needs no removal.
        removed = [] if self._cleared else [block_hash for block_hash, held in self._held.items() if not held]
        events = KvEvents(stored=stored, removed=removed, cleared=self._cleared)
        self._held = {}
        self._cleared = False
        return events


def replay(held: set[BlockHash], events: KvEvents | None) -> set[BlockHash]:
    """Apply one report to a consumer's set `held` (in place), as a gateway does; returns it."""
    if events is not None:
        if events.cleared:
            held.clear()
        held.update(events.stored)
        held.difference_update(events.removed)
    return held


class KvEventReplay:
    """A consumer's view replayed from every report the worker sent, checked against what the
    block manager holds (debug mode: `held_block_hashes` walks every block)."""

    def __init__(self) -> None:
        self.held: set[BlockHash] = set()

    def apply(self, events: KvEvents | None) -> None:
        replay(self.held, events)

    def check(self, held_now: set[BlockHash]) -> None:
        missing, stale = held_now - self.held, self.held - held_now
        assert not missing and not stale, (f"KV events disagree with the prefix cache: {len(missing)} held hashes"
                                           f" never reported, {len(stale)} reported hashes no longer held")
