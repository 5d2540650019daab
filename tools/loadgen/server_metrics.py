"""The server's own view of a run, from its Prometheus `/metrics` (vLLM's metric names).

Counters (prefix-cache queries and hits, preemptions, token totals) are read before and after
the run and differenced; gauges (KV-cache usage per tier, queue lengths) are sampled while it
runs and their peaks kept. A metric the server does not export is reported as missing (None),
never as zero.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass

import httpx

COUNTERS = {
    "prefix_cache_queries": "vllm:prefix_cache_queries_total",
    "prefix_cache_hits": "vllm:prefix_cache_hits_total",
    "num_preemptions": "vllm:num_preemptions_total",
    "prompt_tokens": "vllm:prompt_tokens_total",
    "generation_tokens": "vllm:generation_tokens_total",
}
GAUGES = {
    "kv_cache_usage": "vllm:kv_cache_usage_perc",
    "gpu_cache_usage": "vllm:gpu_cache_usage_perc",
    "cpu_cache_usage": "vllm:cpu_cache_usage_perc",
    "num_running": "vllm:num_requests_running",
    "num_waiting": "vllm:num_requests_waiting",
}


def parse_prometheus(text: str) -> dict[str, float]:
    """Metric name -> value, summed over label sets (one server may label several models)."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_and_labels, _, rest = line.rpartition("}") if "}" in line else line.partition(" ")
        name = name_and_labels.split("{", 1)[0].strip()
        fields = rest.split()
        if not name or not fields:
            continue
        try:
            value = float(fields[0])
        except ValueError:
            continue
        if not math.isnan(value):
            values[name] = values.get(name, 0.0) + value
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
