"""Prometheus metrics under vLLM's names, so existing dashboards work unchanged.

Cache, queue and prefix-cache figures come from the worker's `Stats` (cumulative counters on
the worker side, turned into counter increments here); token counts and latencies are
measured by the gateway as deltas arrive. Each app owns its registry.

With several API servers on one port (`--api-server-count`, gateway/http/api_servers.py) every
process writes its values to files under $PROMETHEUS_MULTIPROC_DIR (prometheus_client's
multiprocess mode) and `/metrics`, whichever process answers it, sums them: each process counts
its own requests, and only the first turns the worker's Stats into metrics (the gauges show its
latest values, so the series stay the single-process ones, without a pid label).
"""

from __future__ import annotations

import os
import re
from collections import deque
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, multiprocess, values
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from spillway.gateway.metrics.request_metrics import RequestMetrics
from spillway.gateway.metrics.spec_metrics import SpecDecodeMetrics
from spillway.protocol.messages import Stats

CONTENT_TYPE = CONTENT_TYPE_LATEST
# The prefix-cache hit-rate gauges cover roughly this many recently queried prompt tokens.
HIT_RATE_WINDOW_TOKENS = 100_000
_TRANSFERS = ("GPU_to_CPU", "CPU_to_GPU")  # vLLM's transfer_type labels
# vLLM's bounds of vllm:iteration_tokens_total, whatever the token budget.
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# A `*_created` sample, or the HELP/TYPE line of such a family.
_CREATED = re.compile(rb"(# (HELP|TYPE) )?[^#\s{]+_created[{\s]")


def observe_repeated(histogram, amount: float, count: int) -> None:
    """`count` observations of one `amount` at once. A step's deltas whose previous tokens came
    in the same step before share their inter-token gap: one bucket update instead of hundreds
    (prometheus_client's `observe` takes one value and walks the bounds in Python each time)."""
    buckets, bounds, total = (getattr(histogram, name, None) for name in ("_buckets", "_upper_bounds", "_sum"))
    if buckets is None or bounds is None or total is None:  # another prometheus_client layout
        for _ in range(count):
            histogram.observe(amount)
        return
    total.inc(amount * count)
    for index, bound in enumerate(bounds):
        if amount <= bound:
            buckets[index].inc(count)
            return


class _WindowedRate:
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


class GatewayMetrics:
    """All of the gateway's metrics, labelled with the served model name."""

    def __init__(self, model_name: str, max_model_len: int | None = None, engine_stats: bool = True) -> None:
        """`engine_stats`: whether this process turns the worker's Stats into metrics (False in
        every API server but the first: the worker sends each the same Stats)."""
        self.registry = CollectorRegistry(auto_describe=True)
        self.engine_stats = engine_stats
        self._shared = shared_registry()  # None: this process's values are all there is
        labels = ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=self.registry, multiprocess_mode="mostrecent").labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=self.registry).labels(model_name)

        self.num_requests_running = gauge("vllm:num_requests_running", "Requests the worker is running.")
        self.num_requests_waiting = gauge("vllm:num_requests_waiting", "Requests waiting in the worker.")
        self.kv_cache_usage = gauge("vllm:kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full).")
        self.gpu_cache_usage = gauge("vllm:gpu_cache_usage_perc", "Fraction of GPU KV blocks in use.")
        self.cpu_cache_usage = gauge("vllm:cpu_cache_usage_perc", "Fraction of CPU KV blocks in use.")
        self.prefix_cache_hit_rate = gauge("vllm:prefix_cache_hit_rate",
                                           "Prefix-cache hits over recently queried prompt tokens.")
        self.prefix_cache_miss_rate = gauge("vllm:prefix_cache_miss_rate",
                                            "Prefix-cache misses over recently queried prompt tokens.")
        self.prefix_cache_queries = counter("vllm:prefix_cache_queries",
                                            "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.num_preemptions = counter("vllm:num_preemptions", "Preemptions in the worker.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Tokens generated.")
        self.iteration_tokens = Histogram("vllm:iteration_tokens_total", "Tokens per engine step: prompt tokens computed plus tokens generated.",
                                          labels, buckets=ITERATION_TOKENS_BUCKETS,
                                          registry=self.registry).labels(model_name)
        self._request_success = Counter("vllm:request_success", "Requests that finished.",
                                        ["model_name", "finished_reason"], registry=self.registry)
        self.model_name = model_name
        for reason in ("stop", "length", "abort"):
            self._request_success.labels(model_name, reason)
        self.requests = RequestMetrics(self.registry, model_name, max_model_len)
        transfers = Counter("vllm:kv_offload_total_bytes", "Bytes of KV copied between the GPU and the CPU tier.",
                            ["model_name", "transfer_type"], registry=self.registry)
        transfer_time = Counter("vllm:kv_offload_total_time", "Seconds spent copying KV between the tiers.",
                                ["model_name", "transfer_type"], registry=self.registry)
        self.kv_offload_bytes = {kind: transfers.labels(model_name, kind) for kind in _TRANSFERS}
        self.kv_offload_time = {kind: transfer_time.labels(model_name, kind) for kind in _TRANSFERS}
        self.external_prefix_cache_queries = counter("vllm:external_prefix_cache_queries",
                                                     "Prompt tokens looked up in the CPU KV tier.")
        self.external_prefix_cache_hits = counter("vllm:external_prefix_cache_hits",
                                                  "Prompt tokens found in the CPU KV tier.")
        cached_tokens = Counter("spillway:cached_tokens", "Prompt tokens served from the prefix cache, by tier.",
                                ["model_name", "source"], registry=self.registry)
        self.cached_tokens = {source: cached_tokens.labels(model_name, source) for source in ("gpu", "cpu")}
        self.invariants_ok = gauge("spillway:kv_invariants_ok",
                                   "1 if the worker's block manager invariants held when last checked, 0 if "
                                   "not, NaN until a check (debug mode, or a CHECK_INVARIANTS control).")
        if engine_stats:
            self.invariants_ok.set(float("nan"))  # a routine report does not walk the blocks
        self._hit_rate = _WindowedRate(HIT_RATE_WINDOW_TOKENS)
        self.spec_decode = SpecDecodeMetrics(self.registry, model_name)
        self._last: Stats | None = None

    def on_stats(self, stats: Stats) -> None:
        """Fold in one Stats snapshot; a fresh worker (counters back at zero) starts over."""
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
        self._hit_rate.add(queries, hits)
        rate = self._hit_rate.hit_rate
        self.prefix_cache_hit_rate.set(rate)
        self.prefix_cache_miss_rate.set(1.0 - rate if self._hit_rate.queries else 0.0)
        self.num_requests_running.set(stats.num_running)
        self.num_requests_waiting.set(stats.num_waiting)
        self.kv_cache_usage.set(stats.gpu_cache_usage)
        self.gpu_cache_usage.set(stats.gpu_cache_usage)
        self.cpu_cache_usage.set(stats.cpu_cache_usage)
        if stats.invariants_ok is not None:  # None: not checked for this report
            self.invariants_ok.set(1 if stats.invariants_ok else 0)
        self._last = stats

    def _cumulative(self) -> Iterator[tuple[str, Counter]]:
        """(Stats field, counter) of the tier's cumulative figures."""
        yield "cpu_prefix_cache_queries", self.external_prefix_cache_queries
        yield "cpu_prefix_cache_hits", self.external_prefix_cache_hits
        yield "cached_tokens_gpu", self.cached_tokens["gpu"]
        yield "cached_tokens_cpu", self.cached_tokens["cpu"]
        for kind, suffix in zip(_TRANSFERS, ("gpu_to_cpu", "cpu_to_gpu")):
            yield f"kv_offload_bytes_{suffix}", self.kv_offload_bytes[kind]
            yield f"kv_offload_seconds_{suffix}", self.kv_offload_time[kind]

    def on_worker_lost(self) -> None:
        if not self.engine_stats:
            return
        self._last = None  # the next worker counts from zero
        self.num_requests_running.set(0)
        self.num_requests_waiting.set(0)

    def on_finished(self, reason: str) -> None:
        self._request_success.labels(self.model_name, reason).inc()

    def token_totals(self) -> tuple[float, float]:
        """(prompt tokens, generated tokens) counted so far, by every API server."""
        labels = {"model_name": self.model_name}
        registry = self._shared or self.registry
        return (registry.get_sample_value("vllm:prompt_tokens_total", labels) or 0.0,
                registry.get_sample_value("vllm:generation_tokens_total", labels) or 0.0)

    @property
    def prefix_hit_rate(self) -> float:
        """The hit rate over the most recent ~HIT_RATE_WINDOW_TOKENS queried prompt tokens."""
        return self._hit_rate.hit_rate

    def render(self) -> bytes:
        """The text exposition without prometheus_client's `*_created` timestamps, which vLLM
        does not export (a dashboard summing a family would count them as values)."""
        lines = generate_latest(self._shared or self.registry).split(b"\n")
        return b"\n".join(line for line in lines if not _CREATED.match(line))


def share_metrics_across_processes(folder: str) -> None:
    """Make the metrics this process creates from now on write their values under `folder`
    (prometheus_client's multiprocess mode), which /metrics of every process sharing it sums.
    Call before any GatewayMetrics exists; processes forked afterwards inherit it."""
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = folder
    values.ValueClass = values.get_value_class()


def shared_registry() -> CollectorRegistry | None:
    """A registry that collects every process's values, in multiprocess mode; None otherwise."""
    folder = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if not folder or values.ValueClass is values.MutexValue:
        return None
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, folder)
    return registry
