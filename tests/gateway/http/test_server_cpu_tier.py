"""`spillway serve` with a CPU KV tier sized by vLLM's environment variable (the real default
model on the CPU device): a prompt pushed out of the GPU pool comes back from the tier, in the
served usage and in /metrics."""

from __future__ import annotations

import json

import httpx
import pytest
from server_helpers import MODEL, metrics_when, real_server

TURN = [(37 * i) % 30000 + 100 for i in range(300)]  # 18 full blocks of 16
FILLER = [(53 * i) % 30000 + 200 for i in range(500)]  # 32 blocks: the whole GPU pool


@pytest.fixture(scope="module")
def server():
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_CPU_KVCACHE_SPACE", "0.05")  # 72 blocks of SmolLM2-135M in float32
        env.delenv("SPILLWAY_CPU_KVCACHE_SPACE", raising=False)
        with real_server("--device", "cpu", "--dtype", "float32", "--max-model-len", "512",
                         "--num-gpu-blocks-override", "32", "--max-num-seqs", "4") as running:
            yield running


def complete(server, prompt: list[int], max_tokens: int) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    response = httpx.post(server.url + "/v1/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


def test_a_prompt_evicted_from_the_gpu_comes_back_from_the_cpu_tier(server):
    first = complete(server, TURN, 4)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    complete(server, FILLER, 1)
    again = complete(server, TURN, 4)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 18 * 16
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    metrics = metrics_when(server, lambda m: m.get('spillway:cached_tokens_total{source="cpu"}') == 288)
    assert metrics['spillway:cached_tokens_total{source="cpu"}'] == 288
    assert metrics['spillway:cached_tokens_total{source="gpu"}'] == 0
    assert metrics["vllm:external_prefix_cache_hits_total"] == 288
    assert metrics["vllm:cpu_cache_usage_perc"] > 0
    block_bytes = 30 * 2 * 16 * 3 * 64 * 4  # layers, K and V, tokens, KV heads, head dim, float32
    assert metrics['vllm:kv_offload_total_bytes_total{transfer_type="CPU_to_GPU"}'] == 18 * block_bytes
    assert metrics['vllm:kv_offload_total_bytes_total{transfer_type="GPU_to_CPU"}'] >= 18 * block_bytes
    assert metrics['vllm:kv_offload_total_time_total{transfer_type="CPU_to_GPU"}'] > 0


def test_the_gpu_cache_gauge_moves_while_a_request_runs(server):
    body = {"model": MODEL, "prompt": FILLER[:400], "max_tokens": 100, "temperature": 0, "ignore_eos": True,
            "stream": True}
    seen = []
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=300) as response:
        for line in response.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"] and len(seen) < 40:
                seen.append(line)
                if len(seen) == 20:
                    busy = metrics_when(server, lambda m: m["vllm:gpu_cache_usage_perc"] > 0)
    assert busy["vllm:gpu_cache_usage_perc"] >= 25 / 32  # 400 + tokens: 26 of 32 blocks referenced
    idle = metrics_when(server, lambda m: m["vllm:gpu_cache_usage_perc"] == 0)
    assert idle["vllm:gpu_cache_usage_perc"] == 0
    assert idle["vllm:cpu_cache_usage_perc"] > 0
