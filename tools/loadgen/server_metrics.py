"""The server's own view of a run, from its Prometheus `/metrics` (vLLM's metric names).

Counters (prefix-cache queries and hits, preemptions, token totals, the CPU tier's offload
traffic and hits) are read before and after the run and differenced; gauges (KV-cache usage per
tier, queue lengths) are sampled while it runs and their peaks kept. A metric the server does
not export is reported as missing (None), never as zero.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

COUNTERS = {
    "prefix_cache_queries": "vllm:prefix_cache_queries_total",
    "prefix_cache_hits": "vllm:prefix_cache_hits_total",
    "num_preemptions": "vllm:num_preemptions_total",
    "prompt_tokens": "vllm:prompt_tokens_total",
    "generation_tokens": "vllm:generation_tokens_total",
    # The CPU tier (vLLM's offloading names; a label picks the direction or the tier).
    "offload_bytes_gpu_to_cpu": 'vllm:kv_offload_total_bytes_total{transfer_type="GPU_to_CPU"}',
    "offload_bytes_cpu_to_gpu": 'vllm:kv_offload_total_bytes_total{transfer_type="CPU_to_GPU"}',
    "offload_seconds_gpu_to_cpu": 'vllm:kv_offload_total_time_total{transfer_type="GPU_to_CPU"}',
    "offload_seconds_cpu_to_gpu": 'vllm:kv_offload_total_time_total{transfer_type="CPU_to_GPU"}',
    "cpu_tier_queries": "vllm:external_prefix_cache_queries_total",
    "cpu_tier_hits": "vllm:external_prefix_cache_hits_total",
    "cached_tokens_gpu": 'spillway:cached_tokens_total{source="gpu"}',
    "cached_tokens_cpu": 'spillway:cached_tokens_total{source="cpu"}',
}
GAUGES = {
    "kv_cache_usage": "vllm:kv_cache_usage_perc",
    "gpu_cache_usage": "vllm:gpu_cache_usage_perc",
    "cpu_cache_usage": "vllm:cpu_cache_usage_perc",
    "num_running": "vllm:num_requests_running",
    "num_waiting": "vllm:num_requests_waiting",
}


# Labels that tell servers, engines or models apart, not what a sample measures: summed over.
IDENTITY_LABELS = frozenset({"model_name", "engine"})


def parse_prometheus(text: str) -> dict[str, float]:
    """Sample name -> value, summed over label sets (one server may label several models or
    engines); a fraction (a `*_perc` gauge, such as each engine's KV cache usage) is their
    mean instead. A sample with other labels is also under `name{label="value",...}` (sorted),
    combined over the identity labels alone. NaN samples are left out."""
    values: dict[str, float] = {}
    counts: dict[str, int] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if math.isnan(sample.value):
                continue
            keys = [sample.name]
            labels = sorted((k, v) for k, v in sample.labels.items() if k not in IDENTITY_LABELS)
            if labels:
                keys.append(sample.name + "{" + ",".join(f'{k}="{v}"' for k, v in labels) + "}")
            for key in keys:
                values[key] = values.get(key, 0.0) + sample.value
                counts[key] = counts.get(key, 0) + 1
    for key, count in counts.items():
        if count > 1 and key.partition("{")[0].endswith("_perc"):
            values[key] /= count
    return values


@dataclass(slots=True)
class GaugeSample:
    t_s: float  # seconds from the run's start (perf_counter() while the run goes on)
    values: dict[str, float]


@dataclass(slots=True)
class ServerReport:
    """What the server's metrics say about the run; None where it exports no such metric."""

    prefix_cache_queries: float | None = None
    prefix_cache_hits: float | None = None
    prefix_cache_hit_rate: float | None = None
    num_preemptions: float | None = None
    prompt_tokens: float | None = None
    generation_tokens: float | None = None
    offload_bytes_gpu_to_cpu: float | None = None
    offload_bytes_cpu_to_gpu: float | None = None
    offload_seconds_gpu_to_cpu: float | None = None
    offload_seconds_cpu_to_gpu: float | None = None
    cpu_tier_queries: float | None = None
    cpu_tier_hits: float | None = None
    cached_tokens_gpu: float | None = None
    cached_tokens_cpu: float | None = None
    kv_cache_usage_peak: float | None = None
    gpu_cache_usage_peak: float | None = None
    cpu_cache_usage_peak: float | None = None
    num_running_peak: float | None = None
    num_waiting_peak: float | None = None
    num_samples: int = 0


class MetricsWatcher:
    """Reads /metrics before, during (every `interval_s`) and after a run."""

    def __init__(self, http: httpx.AsyncClient, interval_s: float) -> None:
        self.http = http
        self.interval_s = interval_s
        self.before: dict[str, float] | None = None
        self.after: dict[str, float] | None = None
        self.samples: list[GaugeSample] = []
        self.failures = 0
        self._task: asyncio.Task | None = None

    async def scrape(self) -> dict[str, float] | None:
        try:
            response = await self.http.get("/metrics", timeout=10.0)
            response.raise_for_status()
        except httpx.HTTPError:
            self.failures += 1
            return None
        return parse_prometheus(response.text)

    async def start(self) -> None:
        self.before = await self.scrape()
        if self.before is not None:
            self._record(self.before)
            self._task = asyncio.create_task(self._sample_forever())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self.before is not None:
            self.after = await self.scrape()
            if self.after is not None:
                self._record(self.after)

    async def _sample_forever(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            values = await self.scrape()
            if values is not None:
                self._record(values)

    def _record(self, values: dict[str, float]) -> None:
        gauges = {key: values[name] for key, name in GAUGES.items() if name in values}
        self.samples.append(GaugeSample(time.perf_counter(), gauges))

    def samples_since(self, t0: float) -> list[GaugeSample]:
        return [GaugeSample(s.t_s - t0, s.values) for s in self.samples]

    def report(self) -> ServerReport | None:
        if self.before is None or self.after is None:
            return None
        report = ServerReport(num_samples=len(self.samples))
        for key, name in COUNTERS.items():
            if name in self.before and name in self.after:
                setattr(report, key, self.after[name] - self.before[name])
        if report.prefix_cache_queries:
            report.prefix_cache_hit_rate = (report.prefix_cache_hits or 0.0) / report.prefix_cache_queries
        for key in GAUGES:
            seen = [s.values[key] for s in self.samples if key in s.values]
            if seen:
                setattr(report, f"{key}_peak", max(seen))
        return report
