"""Prometheus metrics under vLLM's names and labels, so existing dashboards work unchanged.

Every sample of an engine's work carries vLLM's `model_name` and `engine` labels ("0" with one
engine): each engine's EngineClient writes through its own view (gateway/metrics/
engine_metrics.py); the whole gateway's figures (the stats line's token totals and hit rate)
combine the engines. Each app owns its registry.

With several API servers on one port (`--api-server-count`, gateway/http/api_servers.py) every
process writes its values to files under $PROMETHEUS_MULTIPROC_DIR (prometheus_client's
multiprocess mode) and `/metrics`, whichever process answers it, sums them: each process counts
its own requests, and only the first turns the workers' Stats into metrics (the gauges show its
latest values, so the series stay the single-process ones, without a pid label).
"""

from __future__ import annotations

import os
import re

from prometheus_client import CollectorRegistry, generate_latest, multiprocess, values
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from spillway.gateway.metrics.engine_metrics import EngineMetrics
from spillway.gateway.metrics.families import EngineLabels, MetricFamilies

CONTENT_TYPE = CONTENT_TYPE_LATEST
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


class GatewayMetrics:
    """All of the gateway's metrics, labelled with the served model name, and a view per engine
    (`engine(index)`) that labels its samples with that engine as well."""

    def __init__(self, model_name: str, max_model_len: int | None = None, engine_stats: bool = True,
                 num_engines: int = 1) -> None:
        """`engine_stats`: whether this process turns the workers' Stats into metrics (False in
        every API server but the first: the workers send each the same Stats)."""
        assert num_engines >= 1, num_engines
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        self._shared = shared_registry()  # None: this process's values are all there is
        families = MetricFamilies(self.registry)
        self._engines = [EngineMetrics(EngineLabels(families, model_name, str(index)), max_model_len, engine_stats)
                         for index in range(num_engines)]

    def engine(self, index: int) -> EngineMetrics:
        """The metrics of engine `index` (0 to num_engines - 1): what its EngineClient writes."""
        return self._engines[index]

    @property
    def num_engines(self) -> int:
        return len(self._engines)

    def token_totals(self) -> tuple[float, float]:
        """(prompt tokens, generated tokens) counted so far, by every engine and API server."""
        totals = {"vllm:prompt_tokens_total": 0.0, "vllm:generation_tokens_total": 0.0}
        for family in (self._shared or self.registry).collect():
            for sample in family.samples:
                if sample.name in totals and sample.labels.get("model_name") == self.model_name:
                    totals[sample.name] += sample.value
        return totals["vllm:prompt_tokens_total"], totals["vllm:generation_tokens_total"]

    @property
    def prefix_hit_rate(self) -> float:
        """Hits over queries across every engine's window (its most recent
        ~HIT_RATE_WINDOW_TOKENS queried prompt tokens)."""
        queries = sum(engine.hit_rate.queries for engine in self._engines)
        hits = sum(engine.hit_rate.hits for engine in self._engines)
        return hits / queries if queries else 0.0

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
