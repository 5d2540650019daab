"""The CPU KV tier's three switches (flag, environment, LLM argument) and its metrics."""

from __future__ import annotations

import pytest

from spillway.gateway.cli.main import build_parser, main, refusals, worker_config
from spillway.gateway.link.engine_args import cpu_tier_gib, engine_config
from spillway.gateway.metrics.metrics import GatewayMetrics
from spillway.protocol.messages import Stats


@pytest.fixture(autouse=True)
def no_tier_in_the_environment(monkeypatch):
    monkeypatch.delenv("SPILLWAY_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)


@pytest.mark.parametrize("flags", [["--cpu-offload-gb", "40"], ["--kv-offloading-size", "40"],
                                   ["--cpu-offload-gb", "40", "--kv-offloading-size", "40"]])
def test_the_flags_reach_the_worker_config(flags):
    args = build_parser().parse_args(["serve", *flags])
    assert refusals(args) == []
    assert worker_config(args)[0].cpu_offload_gb == 40.0
    args = build_parser().parse_args(["worker", "--connect", "tcp://127.0.0.1:1", *flags])
    assert worker_config(args)[0].cpu_offload_gb == 40.0


@pytest.mark.parametrize("name", ["SPILLWAY_CPU_KVCACHE_SPACE", "VLLM_CPU_KVCACHE_SPACE"])
def test_the_environment_sizes_the_tier_when_no_flag_does(monkeypatch, name):
    monkeypatch.setenv(name, "40")
    assert worker_config(build_parser().parse_args(["serve"]))[0].cpu_offload_gb == 40.0
    assert worker_config(build_parser().parse_args(["serve", "--cpu-offload-gb", "2"]))[0].cpu_offload_gb == 2.0


def test_spillways_variable_wins_over_vllms(monkeypatch):
    monkeypatch.setenv("SPILLWAY_CPU_KVCACHE_SPACE", "3")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "40")
    assert cpu_tier_gib() == 3.0


def test_the_llm_argument_takes_the_same_path():
    # LLM(cpu_offload_gb=40) hands its arguments to engine_config, then starts the worker.
    config, _ = engine_config(None, cpu_offload_gb=40)
    assert config.cpu_offload_gb == 40.0
    assert engine_config(None)[0].cpu_offload_gb == 0.0


@pytest.mark.parametrize("settings, message", [
    ({"cpu_offload_gb": 4, "kv_offloading_size": 8}, "two sizes"),
    ({"cpu_offload_gb": -1}, "GiB >= 0, got -1"),
    ({"cpu_offload_gb": float("inf")}, "GiB >= 0, got inf"),
    ({"cpu_offload_gb": 4, "enable_prefix_caching": False}, "needs prefix caching"),
])
def test_bad_sizes_are_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        engine_config(None, **settings)


def test_a_bad_environment_value_is_refused(monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "lots")
    with pytest.raises(ValueError, match="VLLM_CPU_KVCACHE_SPACE='lots' is not a size in GiB"):
        cpu_tier_gib()


def test_the_load_pace_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv("SPILLWAY_KV_LOAD_GB_S", raising=False)
    assert engine_config(None, cpu_offload_gb=4)[0].kv_load_gb_s == 26.0
    monkeypatch.setenv("SPILLWAY_KV_LOAD_GB_S", "12.5")
    assert engine_config(None, cpu_offload_gb=4)[0].kv_load_gb_s == 12.5
    monkeypatch.setenv("SPILLWAY_KV_LOAD_GB_S", "0")  # full speed always
    assert engine_config(None, cpu_offload_gb=4)[0].kv_load_gb_s == 0.0


@pytest.mark.parametrize("value, message", [("fast", "'fast' is not a rate in GB/s"), ("-5", "must be >= 0"),
                                            ("nan", "must be >= 0")])
def test_a_bad_load_pace_is_refused(monkeypatch, value, message):
    monkeypatch.setenv("SPILLWAY_KV_LOAD_GB_S", value)
    with pytest.raises(ValueError, match=message):
        engine_config(None, cpu_offload_gb=4)


def test_the_cli_reports_a_bad_size(capsys):
    assert main(["serve", "--cpu-offload-gb", "4", "--kv-offloading-size", "5"]) == 1
    assert "two sizes" in capsys.readouterr().err


def sample(metrics: GatewayMetrics, name: str, **labels) -> float:
    return metrics.registry.get_sample_value(name, {"model_name": "m", "engine": "0", **labels})


def test_the_tiers_metrics_follow_the_worker_counters():
    metrics = GatewayMetrics("m")
    engine = metrics.engine(0)
    engine.on_stats(Stats(gpu_cache_usage=0.5, cpu_cache_usage=0.25, cached_tokens_gpu=32, cached_tokens_cpu=16,
                          cpu_prefix_cache_queries=100, cpu_prefix_cache_hits=16,
                          kv_offload_bytes_gpu_to_cpu=4096, kv_offload_bytes_cpu_to_gpu=1024,
                          kv_offload_seconds_gpu_to_cpu=0.5, kv_offload_seconds_cpu_to_gpu=0.25))
    engine.on_stats(Stats(gpu_cache_usage=0.75, cpu_cache_usage=0.5, cached_tokens_gpu=48, cached_tokens_cpu=16,
                          cpu_prefix_cache_queries=130, cpu_prefix_cache_hits=16,
                          kv_offload_bytes_gpu_to_cpu=8192, kv_offload_bytes_cpu_to_gpu=1024,
                          kv_offload_seconds_gpu_to_cpu=1.0, kv_offload_seconds_cpu_to_gpu=0.25))
    assert sample(metrics, "vllm:gpu_cache_usage_perc") == 0.75
    assert sample(metrics, "vllm:cpu_cache_usage_perc") == 0.5
    assert sample(metrics, "spillway:cached_tokens_total", source="gpu") == 48
    assert sample(metrics, "spillway:cached_tokens_total", source="cpu") == 16
    assert sample(metrics, "vllm:external_prefix_cache_queries_total") == 130
    assert sample(metrics, "vllm:external_prefix_cache_hits_total") == 16
    assert sample(metrics, "vllm:kv_offload_total_bytes_total", transfer_type="GPU_to_CPU") == 8192
    assert sample(metrics, "vllm:kv_offload_total_bytes_total", transfer_type="CPU_to_GPU") == 1024
    assert sample(metrics, "vllm:kv_offload_total_time_total", transfer_type="GPU_to_CPU") == 1.0
    assert sample(metrics, "vllm:kv_offload_total_time_total", transfer_type="CPU_to_GPU") == 0.25
    text = metrics.render().decode()
    assert 'vllm:kv_offload_total_bytes_total{engine="0",model_name="m",transfer_type="GPU_to_CPU"} 8192.0' in text


def test_llm_starts_a_worker_with_the_tier_and_refuses_one_larger_than_the_host():
    from spillway.gateway import LLM, SamplingParams

    settings = dict(device="cpu", dtype="float32", max_model_len=256, num_gpu_blocks_override=16)
    with LLM(**settings, cpu_offload_gb=0.05) as llm:
        block_bytes = 30 * 2 * 16 * 3 * 64 * 4  # SmolLM2-135M in float32
        assert llm.ready.num_cpu_blocks == int(0.05 * 2**30) // block_bytes
        llm.generate([[5] * 100], SamplingParams(max_tokens=2), use_tqdm=False)
        assert llm.stats().num_cpu_blocks == llm.ready.num_cpu_blocks
    with pytest.raises(ValueError, match=r"asks for [0-9.]+ GiB of host memory and [0-9.]+ GiB is available"):
        LLM(**settings, cpu_offload_gb=1e6)
