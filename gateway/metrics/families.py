"""The metric families every engine's view shares, and one engine's label values.

Every family is labelled as vLLM labels its own: `model_name`, then `engine` (the engine's
index as a string, "0" with one engine), then the family's own labels (`finished_reason`,
`position`, ...). A family exists once per registry; each engine's view binds its children.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase

ENGINE_LABELS = ("model_name", "engine")


class MetricFamilies:
    """A registry's families by name, each created when first declared: the views of every
    engine declare the same families and so share them."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self._by_name: dict[str, MetricWrapperBase] = {}

    def declare(self, kind: type[MetricWrapperBase], name: str, doc: str, own_labels: tuple[str, ...] = (),
                **options) -> MetricWrapperBase:
        family = self._by_name.get(name)
        if family is None:
            family = kind(name, doc, [*ENGINE_LABELS, *own_labels], registry=self.registry, **options)
            self._by_name[name] = family
        assert isinstance(family, kind), f"{name} is declared as two kinds of metric"
        return family


@dataclass(frozen=True, slots=True)
class EngineLabels:
    """One engine's label values, and its children of the shared families."""

    families: MetricFamilies
    model_name: str
    engine: str  # the engine's index, as vLLM writes it

    def gauge(self, name: str, doc: str) -> Gauge:
        # "mostrecent": with several API servers the series stays the single-process one
        # (no pid label), holding the latest value any process set.
        return self.child(self.families.declare(Gauge, name, doc, multiprocess_mode="mostrecent"))

    def counter(self, name: str, doc: str) -> Counter:
        return self.child(self.families.declare(Counter, name, doc))

    def histogram(self, name: str, doc: str, buckets) -> Histogram:
        return self.child(self.families.declare(Histogram, name, doc, buckets=buckets))

    def counters(self, name: str, doc: str, label: str, values: tuple[str, ...]) -> dict[str, Counter]:
        """A counter per value of the family's own `label`, all created now (shown at zero)."""
        family = self.families.declare(Counter, name, doc, (label,))
        return {value: self.child(family, value) for value in values}

    def child(self, family: MetricWrapperBase, *own_values: str):
        return family.labels(self.model_name, self.engine, *own_values)
