"""vLLM's per-request histograms on /metrics after traffic through the fake worker, and the
stats line `spillway serve` logs while busy."""

from __future__ import annotations

import asyncio
import logging

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server_helpers import MODEL, scrape, server_in_thread
from spillway.gateway.metrics.metrics import GatewayMetrics
from spillway.gateway.metrics.request_metrics import RequestTimes, one_two_five_buckets
from spillway.gateway.http.stats_log import StatsLogger
from spillway.protocol.messages import Stats
from tests.gateway.http.test_server_fake import fake_app, script  # noqa: F401 (fixtures)

STEP_S = 0.01


def histogram(values: dict[str, float], name: str) -> tuple[float, float]:
    """(count, sum) of one histogram in a scrape."""
    return values[f"{name}_count"], values[f"{name}_sum"]


def test_request_histograms_after_traffic(files, script):  # noqa: F811
    app, _ = fake_app(files, script, step_s=STEP_S)
    with server_in_thread(app) as url:
        for max_tokens in (4, 8):
            reply = httpx.post(url + "/v1/completions", timeout=30,
                               json={"model": MODEL, "prompt": "one two three", "max_tokens": max_tokens})
            assert reply.status_code == 200
        reply = httpx.post(url + "/v1/completions", timeout=30,
                           json={"model": MODEL, "prompt": "four", "max_tokens": 3, "n": 2})
        assert reply.status_code == 200
        values = scrape(url)
    # Four sequences finished: two single ones and one request with n=2.
    assert values['vllm:request_success_total{finished_reason="length"}'] == 4
    for name in ("vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
                 "vllm:request_inference_time_seconds", "vllm:request_prefill_time_seconds",
                 "vllm:request_decode_time_seconds", "vllm:request_prompt_tokens",
                 "vllm:request_generation_tokens", "vllm:time_to_first_token_seconds"):
        assert histogram(values, name)[0] == 4, name
    assert histogram(values, "vllm:request_generation_tokens") == (4, 4 + 8 + 3 + 3)
    assert histogram(values, "vllm:request_params_n") == (3, 1 + 1 + 2)
    assert histogram(values, "vllm:request_params_max_tokens") == (3, 4 + 8 + 3)
    # One gap per token after the first, in both inter-token histograms.
    gaps = 3 + 7 + 2 + 2
    assert histogram(values, "vllm:inter_token_latency_seconds")[0] == gaps
    assert histogram(values, "vllm:time_per_output_token_seconds")[0] == gaps
    # The fake worker steps every STEP_S: decoding n tokens takes about (n - 1) steps.
    decode_s = histogram(values, "vllm:request_decode_time_seconds")[1]
    assert gaps * STEP_S * 0.8 < decode_s < gaps * STEP_S * 10
    e2e_s = histogram(values, "vllm:e2e_request_latency_seconds")[1]
    inference_s = histogram(values, "vllm:request_inference_time_seconds")[1]
    queue_s = histogram(values, "vllm:request_queue_time_seconds")[1]
    assert 0 <= queue_s < inference_s <= e2e_s
    assert decode_s < inference_s
    assert values['vllm:request_prompt_tokens_bucket{le="1.0"}'] <= 4  # buckets 1, 2, 5, ... up to max_model_len
    assert 'vllm:request_prompt_tokens_bucket{le="200.0"}' in values
    assert 'vllm:request_prompt_tokens_bucket{le="500.0"}' not in values  # max_model_len is 256


def test_a_single_engine_server_labels_every_sample_engine_0(files, script):  # noqa: F811
    app, _ = fake_app(files, script, step_s=STEP_S)
    with server_in_thread(app) as url:
        reply = httpx.post(url + "/v1/completions", timeout=30,
                           json={"model": MODEL, "prompt": "one two three", "max_tokens": 4})
        assert reply.status_code == 200
        text = httpx.get(url + "/metrics", timeout=10).text
    shown = [sample for family in text_string_to_metric_families(text) for sample in family.samples
             if sample.name.startswith(("vllm:", "spillway:"))]
    assert {(sample.labels["model_name"], sample.labels["engine"]) for sample in shown} == {(MODEL, "0")}
    assert f'vllm:num_requests_running{{engine="0",model_name="{MODEL}"}} ' in text
    assert f'vllm:time_to_first_token_seconds_count{{engine="0",model_name="{MODEL}"}} 1.0' in text


def test_request_times_split_as_vllm_splits_them():
    metrics = GatewayMetrics("m", max_model_len=1000)
    times = RequestTimes(arrival=10.0, num_prompt_tokens=5, first_token=10.5, last_token=12.5, queued_s=0.2,
                         num_generation_tokens=3)
    metrics.engine(0).requests.on_finished(times, now=13.0)
    value = metrics.registry.get_sample_value
    labels = {"model_name": "m", "engine": "0"}
    expected = {"vllm:e2e_request_latency_seconds": 3.0, "vllm:request_queue_time_seconds": 0.2,
                "vllm:request_prefill_time_seconds": 0.3, "vllm:request_decode_time_seconds": 2.0,
                "vllm:request_inference_time_seconds": 2.3}
    for name, seconds in expected.items():
        assert value(f"{name}_sum", labels) == pytest.approx(seconds), name
    assert value("vllm:request_prompt_tokens_sum", labels) == 5


def test_one_two_five_buckets():
    assert one_two_five_buckets(1000) == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000]
    assert one_two_five_buckets(7) == [1, 2, 5]


def test_the_stats_line_is_logged_while_busy_and_not_when_idle(caplog):
    class Client:
        num_in_flight = 0
        last_stats = Stats(num_running=3, num_waiting=2, gpu_cache_usage=0.25)

    metrics = GatewayMetrics("m")
    metrics.engine(0).on_stats(Stats(prefix_cache_queries=100, prefix_cache_hits=40))
    logger = logging.getLogger("test.stats")
    client = Client()

    async def run() -> None:
        stats_log = StatsLogger(client, metrics, logger, interval_s=0.05).start()
        await asyncio.sleep(0)  # it has read the totals
        metrics.engine(0).prompt_tokens.inc(100)
        metrics.engine(0).generation_tokens.inc(10)
        await asyncio.sleep(0.08)  # one busy interval
        client.last_stats = Stats()
        await asyncio.sleep(0.2)  # idle ones
        stats_log.stop()

    with caplog.at_level(logging.INFO, logger="test.stats"):
        asyncio.run(run())
    lines = [r.getMessage() for r in caplog.records if r.name == "test.stats"]
    assert len(lines) == 1, lines
    assert lines[0].startswith("Avg prompt throughput: ")
    assert "Running: 3 reqs, Waiting: 2 reqs, GPU KV cache usage: 25.0%, Prefix cache hit rate: 40.0%" in lines[0]
    prompt_rate = float(lines[0].split("Avg prompt throughput: ")[1].split(" ")[0])
    assert 100 / 0.1 < prompt_rate < 100 / 0.04
