"""vLLM's vllm:iteration_tokens_total on /metrics: the tokens of each engine step the worker's
Stats carry, under vLLM's bucket bounds, observed once (by the first API server only)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from spillway.gateway.metrics.metrics import GatewayMetrics
from spillway.protocol.messages import Stats

VLLM_BOUNDS = ["1.0", "8.0", "16.0", "32.0", "64.0", "128.0", "256.0", "512.0", "1024.0", "2048.0", "4096.0",
               "8192.0", "16384.0", "+Inf"]


def iteration_tokens(metrics: GatewayMetrics) -> tuple[dict[str, float], float, float]:
    """(cumulative count by bound, count, sum) of vllm:iteration_tokens_total."""
    buckets, count, total = {}, None, None
    for family in text_string_to_metric_families(metrics.render().decode()):
        for sample in family.samples:
            if sample.name == "vllm:iteration_tokens_total_bucket":
                buckets[sample.labels["le"]] = sample.value
            elif sample.name == "vllm:iteration_tokens_total_count":
                count = sample.value
            elif sample.name == "vllm:iteration_tokens_total_sum":
                total = sample.value
    return buckets, count, total


def test_each_step_of_a_report_is_observed_once_in_vllms_buckets():
    metrics = GatewayMetrics("m")
    assert iteration_tokens(metrics) == ({bound: 0.0 for bound in VLLM_BOUNDS}, 0.0, 0.0)
    metrics.engine(0).on_stats(Stats(iteration_tokens=[1, 1, 9, 129, 300]))
    metrics.engine(0).on_stats(Stats(num_running=2))  # a report with no steps since the one before
    metrics.engine(0).on_stats(Stats(iteration_tokens=[16, 20000]))

    buckets, count, total = iteration_tokens(metrics)
    assert list(buckets) == VLLM_BOUNDS
    assert [buckets[bound] for bound in VLLM_BOUNDS] == [2, 2, 4, 4, 4, 4, 5, 6, 6, 6, 6, 6, 6, 7]
    assert (count, total) == (7, 1 + 1 + 9 + 129 + 300 + 16 + 20000)


def test_an_api_server_beside_the_first_observes_none():
    metrics = GatewayMetrics("m", engine_stats=False)
    metrics.engine(0).on_stats(Stats(iteration_tokens=[5, 6]))
    assert iteration_tokens(metrics)[1:] == (0.0, 0.0)
