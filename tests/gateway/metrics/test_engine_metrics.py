"""Every engine's samples under vLLM's `engine` label: each engine's view writes its own, the
whole gateway's token totals and hit rate combine them, and the router's counters."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from prometheus_client.parser import text_string_to_metric_families

from spillway.gateway.metrics.engine_metrics import ROUTING_REASONS
from spillway.gateway.metrics.metrics import GatewayMetrics
from spillway.protocol.messages import Stats


def samples(metrics: GatewayMetrics) -> list[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of every sample /metrics would show."""
    text = metrics.render().decode()
    return [(sample.name, sample.labels, sample.value)
            for family in text_string_to_metric_families(text) for sample in family.samples]


def value(metrics: GatewayMetrics, name: str, engine: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, {"model_name": "m", "engine": engine, **labels})


def test_every_sample_carries_the_model_and_one_of_the_engines():
    metrics = GatewayMetrics("m", num_engines=2)
    for engine in (metrics.engine(0), metrics.engine(1)):
        engine.on_stats(Stats(spec_num_accepted_tokens_per_pos=[1], iteration_tokens=[4]))
    shown = samples(metrics)
    assert len(shown) > 100
    assert all(labels["model_name"] == "m" and labels["engine"] in ("0", "1") for _, labels, _ in shown)
    # Each engine has its own child of every family, created before it is written.
    names = {engine: {(name, tuple(sorted(labels.items() - {("engine", engine)})))
                      for name, labels, _ in shown if labels["engine"] == engine} for engine in ("0", "1")}
    assert names["0"] == names["1"]


def test_stats_fed_to_engine_1_show_under_engine_1_only():
    metrics = GatewayMetrics("m", num_engines=2)
    metrics.engine(1).on_stats(Stats(num_running=3, num_waiting=2, gpu_cache_usage=0.5, prefix_cache_queries=100,
                                     prefix_cache_hits=40, num_preemptions=1, cached_tokens_cpu=16,
                                     iteration_tokens=[8, 9], spec_num_drafts=2))
    for engine, expected in (("0", 0), ("1", 1)):
        assert value(metrics, "vllm:num_requests_running", engine) == 3 * expected
        assert value(metrics, "vllm:num_requests_waiting", engine) == 2 * expected
        assert value(metrics, "vllm:kv_cache_usage_perc", engine) == 0.5 * expected
        assert value(metrics, "vllm:prefix_cache_queries_total", engine) == 100 * expected
        assert value(metrics, "vllm:prefix_cache_hit_rate", engine) == 0.4 * expected
        assert value(metrics, "vllm:num_preemptions_total", engine) == expected
        assert value(metrics, "spillway:cached_tokens_total", engine, source="cpu") == 16 * expected
        assert value(metrics, "vllm:iteration_tokens_total_count", engine) == 2 * expected
        assert value(metrics, "vllm:spec_decode_num_drafts_total", engine) == 2 * expected


def test_each_engine_counts_from_its_own_last_stats():
    metrics = GatewayMetrics("m", num_engines=2)
    first, second = metrics.engine(0), metrics.engine(1)
    first.on_stats(Stats(prefix_cache_queries=100))
    second.on_stats(Stats(prefix_cache_queries=10))
    first.on_stats(Stats(prefix_cache_queries=150))  # +50 for engine 0, whatever engine 1 said
    second.on_worker_lost()  # engine 1's replacement counts from zero
    second.on_stats(Stats(prefix_cache_queries=5))
    assert value(metrics, "vllm:prefix_cache_queries_total", "0") == 150
    assert value(metrics, "vllm:prefix_cache_queries_total", "1") == 15


def test_token_totals_sum_every_engine():
    metrics = GatewayMetrics("m", num_engines=3)
    metrics.engine(0).prompt_tokens.inc(100)
    metrics.engine(2).prompt_tokens.inc(20)
    metrics.engine(1).generation_tokens.inc(7)
    metrics.engine(2).generation_tokens.inc(5)
    assert metrics.token_totals() == (120, 12)


def test_the_hit_rate_is_hits_over_queries_of_every_engines_window():
    metrics = GatewayMetrics("m", num_engines=2)
    assert metrics.prefix_hit_rate == 0.0
    metrics.engine(0).on_stats(Stats(prefix_cache_queries=100, prefix_cache_hits=80))
    assert metrics.prefix_hit_rate == 0.8  # engine 1 has looked nothing up: no weight
    metrics.engine(1).on_stats(Stats(prefix_cache_queries=300, prefix_cache_hits=0))
    assert metrics.prefix_hit_rate == pytest.approx(80 / 400)  # not the mean of 0.8 and 0
    assert value(metrics, "vllm:prefix_cache_hit_rate", "0") == 0.8
    assert value(metrics, "vllm:prefix_cache_hit_rate", "1") == 0.0


def test_routed_requests_count_by_engine_and_reason():
    metrics = GatewayMetrics("m", num_engines=2)
    for engine in ("0", "1"):
        for reason in ROUTING_REASONS:
            assert value(metrics, "spillway:routed_requests_total", engine, reason=reason) == 0
    metrics.engine(1).on_routed("prefix")
    metrics.engine(1).on_routed("prefix")
    metrics.engine(0).on_routed("round_robin")
    routed = {(labels["engine"], labels["reason"]): count for name, labels, count in samples(metrics)
              if name == "spillway:routed_requests_total"}
    assert routed == {("0", "prefix"): 0, ("0", "load"): 0, ("0", "round_robin"): 1,
                      ("1", "prefix"): 2, ("1", "load"): 0, ("1", "round_robin"): 0}
    with pytest.raises(KeyError):
        metrics.engine(0).on_routed("random")


def test_an_api_server_beside_the_first_turns_no_engines_stats_into_metrics():
    metrics = GatewayMetrics("m", engine_stats=False, num_engines=2)
    metrics.engine(1).on_stats(Stats(num_running=4, prefix_cache_queries=10))
    metrics.engine(1).on_finished("stop")  # its own requests it counts
    assert value(metrics, "vllm:num_requests_running", "1") == 0
    assert value(metrics, "vllm:prefix_cache_queries_total", "1") == 0
    assert value(metrics, "vllm:request_success_total", "1", finished_reason="stop") == 1


SHARED_PROCESS = """
import sys
from spillway.gateway.metrics.metrics import GatewayMetrics, share_metrics_across_processes
from spillway.protocol.messages import Stats

share_metrics_across_processes(sys.argv[1])
metrics = GatewayMetrics("m", num_engines=2)
metrics.engine(1).on_stats(Stats(num_running=3))
metrics.engine(0).on_stats(Stats(num_running=1))
metrics.engine(0).prompt_tokens.inc(10)
metrics.engine(1).prompt_tokens.inc(5)
print(metrics.token_totals())
sys.stdout.write(metrics.render().decode())
"""


def test_engines_in_multiprocess_mode_keep_their_single_process_series(tmp_path):
    environment = {key: value for key, value in os.environ.items() if key != "PROMETHEUS_MULTIPROC_DIR"}
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(SHARED_PROCESS), str(tmp_path)],
                            capture_output=True, text=True, timeout=60, env=environment, check=True)
    totals, text = result.stdout.split("\n", 1)
    assert totals == "(15.0, 0.0)"
    assert list(tmp_path.iterdir())  # the values went to the shared files
    running = {sample.labels["engine"]: sample.value for family in text_string_to_metric_families(text)
               for sample in family.samples if sample.name == "vllm:num_requests_running"}
    assert running == {"0": 1, "1": 3}
    assert "pid=" not in text


def test_kv_transfer_totals_become_counters_by_direction_and_a_new_worker_counts_from_zero():
    metrics = GatewayMetrics("m", num_engines=2)
    producer, consumer = metrics.engine(0), metrics.engine(1)
    producer.on_stats(Stats(kv_transfer_bytes_sent=4096, kv_transfer_seconds_sent=0.5))
    producer.on_stats(Stats(kv_transfer_bytes_sent=6144, kv_transfer_seconds_sent=0.75))
    consumer.on_stats(Stats(kv_transfer_bytes_received=6144, kv_transfer_seconds_received=1.0, kv_transfer_failures=1))
    consumer.on_worker_lost()
    consumer.on_stats(Stats(kv_transfer_bytes_received=2048, kv_transfer_seconds_received=0.25))
    expected = {("0", "sent"): (6144, 0.75), ("0", "received"): (0, 0.0), ("1", "received"): (8192, 1.25),
                ("1", "sent"): (0, 0.0)}
    for (engine, direction), (num_bytes, seconds) in expected.items():
        assert value(metrics, "vllm:kv_transfer_bytes_total", engine, direction=direction) == num_bytes
        assert value(metrics, "vllm:kv_transfer_seconds_total", engine, direction=direction) == seconds
    assert (value(metrics, "vllm:kv_transfer_failures_total", "0"),
            value(metrics, "vllm:kv_transfer_failures_total", "1")) == (0, 1)
