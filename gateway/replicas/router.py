"""Which replica takes a request (`--routing prefix|load|round-robin`).

    prefix        the replica holding the longest run of the prompt's leading blocks (held or
                  being computed: cache_index.py), unless it carries more than `slack` requests
                  beyond the least loaded one: then the least loaded (a hot prefix spreads once
                  its replica is loaded, and the next replica caches it too); no match: least loaded
    load          the replica with the fewest requests in flight (vLLM's data-parallel balancer
                  weighs queue lengths the same way)
    round-robin   each eligible replica in turn

Load is what the gateway knows without asking: requests in flight on each replica's link,
counted when sent and when they end, so a burst is spread as it arrives, not a stats report
later. Ties go to the replica after the one chosen last, so equal replicas take turns.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

from spillway.gateway.replicas.cache_index import CacheIndex

ROUTING_POLICIES = ("prefix", "load", "round-robin")


class Reason(str, enum.Enum):
    """Why a replica was chosen (the `reason` label of spillway:routed_requests)."""

    PREFIX = "prefix"
    LOAD = "load"
    ROUND_ROBIN = "round_robin"


def balance_slack(max_num_seqs: int) -> int:
    """Requests a prefix's replica may carry beyond the least loaded one before the next request
    goes elsewhere: a quarter of a replica's batch. Less, and a conversation leaves its cache as
    soon as a neighbour idles; more, and a hot prefix queues on one replica while another has
    room for a whole batch."""
    return max(1, max_num_seqs // 4)


class Router:
    def __init__(self, policy: str, num_replicas: int, max_num_seqs: int) -> None:
        if policy not in ROUTING_POLICIES:
            raise ValueError(f"routing policy {policy!r} is not one of {', '.join(ROUTING_POLICIES)}")
        self.policy = policy
        self.num_replicas = num_replicas
        self.index = CacheIndex(num_replicas)
        self.slack = balance_slack(max_num_seqs)
        self._next = 0  # where the search for a tie's winner starts

    def choose(self, block_hashes: Sequence[bytes], loads: Sequence[int], eligible: Sequence[bool]) -> tuple[int, Reason]:
        """(replica, why) for a request whose prompt has `block_hashes`; `loads[r]`: requests in
        flight on replica r; only `eligible` replicas are taken (at least one must be)."""
        candidates = [r for r in self._turn_order() if eligible[r]]
        assert candidates, "no eligible replica"
        if self.policy == "round-robin":
            return self._take(candidates[0], Reason.ROUND_ROBIN)
        least = min(candidates, key=lambda r: loads[r])  # the first in turn order among equals
        if self.policy == "load" or not block_hashes:
            return self._take(least, Reason.LOAD)
        mask = sum(1 << r for r in candidates)
        runs = self.index.matched_blocks(block_hashes, mask)
        best = max(candidates, key=lambda r: (runs[r], -loads[r]))
        if runs[best] == 0 or loads[best] - loads[least] > self.slack:
            return self._take(least, Reason.LOAD)
        return self._take(best, Reason.PREFIX)

    def _turn_order(self) -> list[int]:
        n = self.num_replicas
        return [(self._next + k) % n for k in range(n)]

    def _take(self, replica: int, reason: Reason) -> tuple[int, Reason]:
        self._next = (replica + 1) % self.num_replicas
        return replica, reason
