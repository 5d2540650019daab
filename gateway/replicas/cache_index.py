"""Which replica holds which prefix blocks, as the gateway knows it.

Two sources, both exact, neither a scan of a worker's cache:

    held     the blocks a replica's worker reports holding (KvEvents in its StepOutputs:
             stored, removed, cleared), in its GPU pool or its CPU tier
    routed   the prompt blocks of the requests in flight on a replica: it will hold them
             once their prefill runs, before its events can say so, so the second request of
             a burst on one prefix follows the first. Only the blocks at positions 0, 1, 3,
             7, ... (2^k - 1) and the last are recorded: a chained hash stands for the whole
             prefix before it, so they give a match at least half as long as the true one, at
             O(log n) per request rather than O(n) (tools/bench/serve/routing.py)

Each block hash maps to a bitmask of replicas (bit r: replica r), one dict per source;
`matched_blocks` walks a prompt's hashes once for every replica at the same time (held, exact),
then looks its sampled positions up among the routed.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from spillway.protocol.messages import KvEvents


class CacheIndex:
    def __init__(self, num_replicas: int) -> None:
        self.num_replicas = num_replicas
        self._held: dict[bytes, int] = {}
        self._routed: dict[bytes, int] = {}
        self._routed_counts: list[Counter[bytes]] = [Counter() for _ in range(num_replicas)]

    def apply(self, replica: int, events: KvEvents) -> None:
        """Fold in one report of replica `replica`'s worker, in the order they came."""
        bit = 1 << replica
        if events.cleared:
            self.forget(replica)
        held = self._held
        for block_hash in events.stored:
            held[block_hash] = held.get(block_hash, 0) | bit
        for block_hash in events.removed:
            mask = held.get(block_hash, 0) & ~bit
            if mask:
                held[block_hash] = mask
            else:
                held.pop(block_hash, None)

    def forget(self, replica: int) -> None:
        """Replica `replica` holds nothing any more (its cache was reset, or its worker lost)."""
        keep = ~(1 << replica)
        self._held = {block_hash: mask & keep for block_hash, mask in self._held.items() if mask & keep}

    def route(self, replica: int, block_hashes: Sequence[bytes]) -> None:
        """A request with these prompt blocks went to `replica`."""
        bit, counts = 1 << replica, self._routed_counts[replica]
        for block_hash in sampled(block_hashes):
            counts[block_hash] += 1
            self._routed[block_hash] = self._routed.get(block_hash, 0) | bit

    def unroute(self, replica: int, block_hashes: Sequence[bytes]) -> None:
        """That request has ended: its blocks are held now, or were never computed, as the
        replica's events say."""
        keep, counts = ~(1 << replica), self._routed_counts[replica]
        for block_hash in sampled(block_hashes):
            left = counts[block_hash] - 1
            if left > 0:
                counts[block_hash] = left
                continue
            del counts[block_hash]
            mask = self._routed.get(block_hash, 0) & keep
            if mask:
                self._routed[block_hash] = mask
            else:
                self._routed.pop(block_hash, None)

    def matched_blocks(self, block_hashes: Sequence[bytes], replicas: int) -> list[int]:
        """For each replica, how many of the prompt's leading blocks it holds or is computing
        (0 for replicas outside the bitmask `replicas`). O(the longest held match + log n)."""
        runs = self._held_runs(block_hashes, replicas)
        routed = self._routed
        if routed:
            for position in _sampled_positions(len(block_hashes)):
                mask = routed.get(block_hashes[position], 0) & replicas
                while mask:
                    low = mask & -mask
                    replica = low.bit_length() - 1
                    runs[replica] = max(runs[replica], position + 1)
                    mask ^= low
        return runs

    def _held_runs(self, block_hashes: Sequence[bytes], replicas: int) -> list[int]:
        runs = [0] * self.num_replicas
        alive, held = replicas, self._held
        for position, block_hash in enumerate(block_hashes):
            still = alive & held.get(block_hash, 0)
            gone = alive ^ still
            while gone:
                low = gone & -gone
                runs[low.bit_length() - 1] = position
                gone ^= low
            alive = still
            if not alive:
                return runs
        while alive:
            low = alive & -alive
            runs[low.bit_length() - 1] = len(block_hashes)
            alive ^= low
        return runs

    def num_held(self, replica: int) -> int:
        """Blocks replica `replica` reports holding (O(index); tests and debugging)."""
        bit = 1 << replica
        return sum(1 for mask in self._held.values() if mask & bit)


def _sampled_positions(num_blocks: int) -> list[int]:
    """0, 1, 3, 7, ... below `num_blocks`, and the last position."""
    positions, position = [], 0
    while position < num_blocks - 1:
        positions.append(position)
        position = 2 * position + 1
    return positions + [num_blocks - 1] if num_blocks else []


def sampled(block_hashes: Sequence[bytes]) -> list[bytes]:
    """The hashes at `_sampled_positions`: what the routed index records of a prompt."""
    return [block_hashes[position] for position in _sampled_positions(len(block_hashes))]
