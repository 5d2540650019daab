"""The invariants gauge follows the reports that checked them and ignores the others."""

from __future__ import annotations

import math

from spillway.gateway.metrics.metrics import GatewayMetrics
from spillway.protocol.messages import Stats


def gauge_value(metrics: GatewayMetrics) -> float:
    return metrics.registry.get_sample_value("spillway:kv_invariants_ok", {"model_name": "m", "engine": "0"})


def test_a_report_that_did_not_check_leaves_the_gauge_as_the_last_check_set_it():
    metrics = GatewayMetrics("m")
    metrics.engine(0).on_stats(Stats(num_running=1))
    assert math.isnan(gauge_value(metrics))  # never checked: neither held (1) nor broken (0)
    metrics.engine(0).on_stats(Stats(invariants_ok=True))
    metrics.engine(0).on_stats(Stats(num_running=2))  # a routine report: invariants_ok is None
    assert gauge_value(metrics) == 1
    metrics.engine(0).on_stats(Stats(invariants_ok=False))
    metrics.engine(0).on_stats(Stats())
    assert gauge_value(metrics) == 0
