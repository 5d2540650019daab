"""The speculative-decoding counters of /metrics, under vLLM's names, from the worker's
cumulative Stats."""

from __future__ import annotations

from prometheus_client import Counter

from spillway.gateway.metrics.families import EngineLabels
from spillway.protocol.messages import Stats


class SpecDecodeMetrics:
    """One engine's `vllm:spec_decode_num_drafts_total`, `..._num_draft_tokens_total`,
    `..._num_accepted_tokens_total` and `..._num_accepted_tokens_per_pos_total{position}`."""

    def __init__(self, labels: EngineLabels) -> None:
        counter = labels.counter
        self.num_drafts = counter("vllm:spec_decode_num_drafts", "Verified requests that had draft tokens.")
        self.num_draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Draft tokens verified.")
        self.num_accepted_tokens = counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self._per_position = labels.families.declare(Counter, "vllm:spec_decode_num_accepted_tokens_per_pos",
                                                     "Draft tokens accepted, by their position in the draft.",
                                                     ("position",))
        self._labels = labels

    def on_stats(self, stats: Stats, last: Stats) -> None:
        """Add what changed since `last` (a fresh worker's counters start again at zero)."""
        self.num_drafts.inc(max(stats.spec_num_drafts - last.spec_num_drafts, 0))
        self.num_draft_tokens.inc(max(stats.spec_num_draft_tokens - last.spec_num_draft_tokens, 0))
        self.num_accepted_tokens.inc(max(stats.spec_num_accepted_tokens - last.spec_num_accepted_tokens, 0))
        before = last.spec_num_accepted_tokens_per_pos
        for position, count in enumerate(stats.spec_num_accepted_tokens_per_pos):
            previous = before[position] if position < len(before) else 0
            self._labels.child(self._per_position, str(position)).inc(max(count - previous, 0))
