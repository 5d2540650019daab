"""Which replica takes a request (`--routing prefix|load|round-robin`).

    prefix        the replica holding the longest run of the prompt's leading blocks (held or
                  being computed: cache_index.py), unless it carries more requests beyond the
                  least loaded one than the blocks it would save there (at most `slack`): then
                  the least loaded; no match: the least loaded. So a shared system prompt of a
                  few blocks spreads to the next replica once its first is a few requests ahead
                  (both then hold it, and new conversations go by load), while a long history
                  keeps its conversation in place under a real imbalance
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
    """The most requests a prefix's replica may carry beyond the least loaded one before the next
    request goes elsewhere, however long its match: a quarter of a replica's batch. More, and a
    hot prefix queues on one replica while another has room for a whole batch."""
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
        # Each block the best replica saves over the least loaded buys one request of imbalance.
        allowed = min(runs[best] - runs[least], self.slack)
        if runs[best] == 0 or loads[best] - loads[least] > allowed:
            return self._take(least, Reason.LOAD)
        return self._take(best, Reason.PREFIX)

    def _turn_order(self) -> list[int]:
        n = self.num_replicas
        return [(self._next + k) % n for k in range(n)]

    def _take(self, replica: int, reason: Reason) -> tuple[int, Reason]:
        self._next = (replica + 1) % self.num_replicas
        return replica, reason
