"""The stats line `spillway serve` logs every 10 s while it has work, as `vllm serve` does:

    Avg prompt throughput: 812.4 tokens/s, Avg generation throughput: 301.2 tokens/s,
    Running: 12 reqs, Waiting: 3 reqs, GPU KV cache usage: 41.0%, Prefix cache hit rate: 63.5%

Throughputs are over the interval; the counts and KV usage are the worker's latest Stats; the
hit rate is /metrics' gauge (the most recent ~100,000 queried prompt tokens). An idle server
logs nothing, after one last line for the interval in which its work ended.
"""

from __future__ import annotations

import asyncio
import logging
import time

from spillway.gateway.link.client import EngineClient
from spillway.gateway.metrics.metrics import GatewayMetrics
from spillway.protocol.messages import Stats

STATS_LOG_INTERVAL_S = 10.0


class StatsLogger:
    """A task that logs one stats line per interval in which the server had work."""

    def __init__(self, client: EngineClient, metrics: GatewayMetrics, logger: logging.Logger,
                 interval_s: float = STATS_LOG_INTERVAL_S) -> None:
        self._client = client
        self._metrics = metrics
        self._logger = logger
        self._interval_s = interval_s
        self._task: asyncio.Task | None = None

    def start(self) -> StatsLogger:
        self._task = asyncio.create_task(self._run(), name="spillway-stats-log")
        return self

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _run(self) -> None:
        last_time = time.monotonic()
        last_prompt, last_generation = self._metrics.token_totals()
        while True:
            await asyncio.sleep(self._interval_s)
            now = time.monotonic()
            prompt, generation = self._metrics.token_totals()
            if self._busy() or prompt != last_prompt or generation != last_generation:
                elapsed = now - last_time
                self._logger.info(self.line((prompt - last_prompt) / elapsed, (generation - last_generation) / elapsed))
            last_time, last_prompt, last_generation = now, prompt, generation

    def _busy(self) -> bool:
        stats = self._client.last_stats
        return self._client.num_in_flight > 0 or (stats is not None and stats.num_running + stats.num_waiting > 0)

    def line(self, prompt_throughput: float, generation_throughput: float) -> str:
        stats = self._client.last_stats
        if stats is None:
            stats = Stats()
        running, waiting, usage = stats.num_running, stats.num_waiting, stats.gpu_cache_usage
        return (f"Avg prompt throughput: {prompt_throughput:.1f} tokens/s, "
                f"Avg generation throughput: {generation_throughput:.1f} tokens/s, "
                f"Running: {running} reqs, Waiting: {waiting} reqs, GPU KV cache usage: {100 * usage:.1f}%, "
                f"Prefix cache hit rate: {100 * self._metrics.prefix_hit_rate:.1f}%")
