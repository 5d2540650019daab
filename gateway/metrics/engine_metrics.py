"""One engine's metrics: the view EngineClient writes, every sample labelled with its engine.

Cache, queue and prefix-cache figures come from the engine's worker's `Stats` (cumulative
counters on the worker side, turned into counter increments here, against the last Stats of
this engine only); token counts and latencies are measured by the gateway as deltas arrive.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from prometheus_client import Counter

from spillway.gateway.metrics.families import EngineLabels
from spillway.gateway.metrics.request_metrics import RequestMetrics
from spillway.gateway.metrics.spec_metrics import SpecDecodeMetrics
from spillway.protocol.messages import Stats

# The prefix-cache hit-rate gauges cover roughly this many recently queried prompt tokens.
HIT_RATE_WINDOW_TOKENS = 100_000
TRANSFERS = ("GPU_to_CPU", "CPU_to_GPU")  # vLLM's transfer_type labels
# KV moved between engines (disaggregated prefill and decode): pulled into this one, served from it.
KV_TRANSFER_DIRECTIONS = ("received", "sent")
FINISHED_REASONS = ("stop", "length", "abort")
# Why the router sent a request to an engine: it held the longest cached prefix, it was the
# least loaded, or its turn came.
ROUTING_REASONS = ("prefix", "load", "round_robin")
# vLLM's bounds of vllm:iteration_tokens_total, whatever the token budget.
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class WindowedRate:
    """Hits over queries across the most recent ~window queried tokens."""

    def __init__(self, window: int) -> None:
        self.window = window
        self.samples: deque[tuple[int, int]] = deque()
        self.queries = 0
        self.hits = 0

    def add(self, queries: int, hits: int) -> None:
        if queries <= 0:
            return
        self.samples.append((queries, hits))
        self.queries += queries
        self.hits += hits
        while len(self.samples) > 1 and self.queries - self.samples[0][0] >= self.window:
            old_queries, old_hits = self.samples.popleft()
            self.queries -= old_queries
            self.hits -= old_hits

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class EngineMetrics:
    """The gauges, counters and histograms of one engine, bound to its `engine` label."""

    def __init__(self, labels: EngineLabels, max_model_len: int | None = None, engine_stats: bool = True) -> None:
        """`engine_stats`: whether this process turns the worker's Stats into metrics (False in
        every API server but the first: the worker sends each the same Stats)."""
        self.engine_stats = engine_stats
        gauge, counter = labels.gauge, labels.counter
        self.num_requests_running = gauge("vllm:num_requests_running", "Requests the worker is running.")
        self.num_requests_waiting = gauge("vllm:num_requests_waiting", "Requests waiting in the worker.")
        self.kv_cache_usage = gauge("vllm:kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full).")
        self.gpu_cache_usage = gauge("vllm:gpu_cache_usage_perc", "Fraction of GPU KV blocks in use.")
        self.cpu_cache_usage = gauge("vllm:cpu_cache_usage_perc", "Fraction of CPU KV blocks in use.")
        self.prefix_cache_hit_rate = gauge("vllm:prefix_cache_hit_rate",
                                           "Prefix-cache hits over recently queried prompt tokens.")
        self.prefix_cache_miss_rate = gauge("vllm:prefix_cache_miss_rate",
                                            "Prefix-cache misses over recently queried prompt tokens.")
        self.prefix_cache_queries = counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.num_preemptions = counter("vllm:num_preemptions", "Preemptions in the worker.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Tokens generated.")
        self.iteration_tokens = labels.histogram(
            "vllm:iteration_tokens_total", "Tokens per engine step: prompt tokens computed plus tokens generated.",
            ITERATION_TOKENS_BUCKETS)
        self._request_success = labels.counters("vllm:request_success", "Requests that finished.",
                                                "finished_reason", FINISHED_REASONS)
        self.requests = RequestMetrics(labels, max_model_len)
        self.kv_offload_bytes = labels.counters("vllm:kv_offload_total_bytes",
                                                "Bytes of KV copied between the GPU and the CPU tier.",
                                                "transfer_type", TRANSFERS)
        self.kv_offload_time = labels.counters("vllm:kv_offload_total_time",
                                               "Seconds spent copying KV between the tiers.",
                                               "transfer_type", TRANSFERS)
        # vLLM's KV connectors each export their own per-transfer histograms (the NIXL one's
        # vllm:nixl_bytes_transferred, vllm:nixl_xfer_time_seconds); the worker reports cumulative
        # totals whatever the connector's name, so these are counters of those totals by direction.
        self.kv_transfer_bytes = labels.counters("vllm:kv_transfer_bytes",
                                                 "Bytes of KV blocks moved between engines (disaggregated prefill "
                                                 "and decode), by direction.", "direction", KV_TRANSFER_DIRECTIONS)
        self.kv_transfer_seconds = labels.counters("vllm:kv_transfer_seconds",
                                                   "Seconds spent moving KV blocks between engines, by direction.",
                                                   "direction", KV_TRANSFER_DIRECTIONS)
        self.kv_transfer_failures = counter("vllm:kv_transfer_failures",
                                            "KV pulls from another engine that failed (kv_load_failure_policy "
                                            "applied).")
        self.external_prefix_cache_queries = counter("vllm:external_prefix_cache_queries",
                                                     "Prompt tokens looked up in the CPU KV tier.")
        self.external_prefix_cache_hits = counter("vllm:external_prefix_cache_hits",
                                                  "Prompt tokens found in the CPU KV tier.")
        self.cached_tokens = labels.counters("spillway:cached_tokens",
                                             "Prompt tokens served from the prefix cache, by tier.", "source",
                                             ("gpu", "cpu"))
        self.invariants_ok = gauge("spillway:kv_invariants_ok",
                                   "1 if the worker's block manager invariants held when last checked, 0 if "
                                   "not, NaN until a check (debug mode, or a CHECK_INVARIANTS control).")
        if engine_stats:
            self.invariants_ok.set(float("nan"))  # a routine report does not walk the blocks
        self._routed = labels.counters("spillway:routed_requests", "Requests the router sent to this engine, by why.",
                                       "reason", ROUTING_REASONS)
        self.hit_rate = WindowedRate(HIT_RATE_WINDOW_TOKENS)
        self.spec_decode = SpecDecodeMetrics(labels)
        self._last: Stats | None = None

    def on_stats(self, stats: Stats) -> None:
        """Fold in one Stats snapshot of this engine; a fresh worker (counters back at zero)
        starts over."""
        if not self.engine_stats:
            return
        last = self._last or Stats()
        queries = max(stats.prefix_cache_queries - last.prefix_cache_queries, 0)
        hits = max(stats.prefix_cache_hits - last.prefix_cache_hits, 0)
        self.prefix_cache_queries.inc(queries)
        self.prefix_cache_hits.inc(hits)
        self.num_preemptions.inc(max(stats.num_preemptions - last.num_preemptions, 0))
        for name, metric in self._cumulative():
            metric.inc(max(getattr(stats, name) - getattr(last, name), 0))
        self.spec_decode.on_stats(stats, last)
        for num_tokens in stats.iteration_tokens:
            self.iteration_tokens.observe(num_tokens)
        self.hit_rate.add(queries, hits)
        rate = self.hit_rate.hit_rate
        self.prefix_cache_hit_rate.set(rate)
        self.prefix_cache_miss_rate.set(1.0 - rate if self.hit_rate.queries else 0.0)
        self.num_requests_running.set(stats.num_running)
        self.num_requests_waiting.set(stats.num_waiting)
        self.kv_cache_usage.set(stats.gpu_cache_usage)
        self.gpu_cache_usage.set(stats.gpu_cache_usage)
        self.cpu_cache_usage.set(stats.cpu_cache_usage)
        if stats.invariants_ok is not None:  # None: not checked for this report
            self.invariants_ok.set(1 if stats.invariants_ok else 0)
        self._last = stats

    def _cumulative(self) -> Iterator[tuple[str, Counter]]:
        """(Stats field, counter) of the cumulative figures: the CPU tier's, the KV transfers'."""
        yield "cpu_prefix_cache_queries", self.external_prefix_cache_queries
        yield "cpu_prefix_cache_hits", self.external_prefix_cache_hits
        yield "cached_tokens_gpu", self.cached_tokens["gpu"]
        yield "cached_tokens_cpu", self.cached_tokens["cpu"]
        for kind, suffix in zip(TRANSFERS, ("gpu_to_cpu", "cpu_to_gpu")):
            yield f"kv_offload_bytes_{suffix}", self.kv_offload_bytes[kind]
            yield f"kv_offload_seconds_{suffix}", self.kv_offload_time[kind]
        for direction in KV_TRANSFER_DIRECTIONS:
            yield f"kv_transfer_bytes_{direction}", self.kv_transfer_bytes[direction]
            yield f"kv_transfer_seconds_{direction}", self.kv_transfer_seconds[direction]
        yield "kv_transfer_failures", self.kv_transfer_failures

    def on_worker_lost(self) -> None:
        if not self.engine_stats:
            return
        self._last = None  # the next worker counts from zero
        self.num_requests_running.set(0)
        self.num_requests_waiting.set(0)

    def on_finished(self, reason: str) -> None:
        self._request_success[reason].inc()

    def on_routed(self, reason: str) -> None:
        """The router sent a request here, for `reason` (one of ROUTING_REASONS)."""
        self._routed[reason].inc()
