"""`spillway serve` on the real default model with a 2 s heartbeat bound: each engine step's
tokens reach vllm:iteration_tokens_total; a prefill longer than the bound keeps the worker; a
stopped worker (SIGSTOP) turns /health to 503, ends its streams with an error, and is killed
and replaced."""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import pytest

from server_helpers import MODEL, real_server, scrape

pytestmark = pytest.mark.slow  # starts `spillway serve` with the real default model

BOUNDS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]


@pytest.fixture(scope="module")
def server():
    # Steps not run ahead: each step commits its own tokens, so the counts below are exact.
    with real_server("--max-model-len", "2048", "--no-async-scheduling", "--worker-heartbeat-timeout", "2") as running:
        yield running


def iteration_tokens(url: str) -> dict[str, float]:
    return {key: value for key, value in scrape(url).items() if key.startswith("vllm:iteration_tokens_total")}


def test_each_step_of_a_request_is_one_observation(server):
    before = iteration_tokens(server.url)
    assert [key for key in before if key.endswith("_bucket{le=\"%.1f\"}" % BOUNDS[0])]
    assert {f'vllm:iteration_tokens_total_bucket{{le="{bound:.1f}"}}' for bound in BOUNDS} < set(before)
    reply = httpx.post(server.url + "/v1/completions", timeout=120, json={
        "model": MODEL, "max_tokens": 6, "ignore_eos": True, "temperature": 0,
        "prompt": "Zebras and quinces: " + " ".join(f"word{i}" for i in range(40))})
    assert reply.status_code == 200
    prompt_tokens = reply.json()["usage"]["prompt_tokens"]
    assert 64 < prompt_tokens < 256
    after = iteration_tokens(server.url)

    def added(key: str) -> float:
        return after[key] - before[key]

    # One prefill step (the prompt and its first token), then five steps of one token each.
    assert added("vllm:iteration_tokens_total_count") == 6
    assert added("vllm:iteration_tokens_total_sum") == prompt_tokens + 6
    assert added('vllm:iteration_tokens_total_bucket{le="1.0"}') == 5
    assert added('vllm:iteration_tokens_total_bucket{le="64.0"}') == 5
    assert added('vllm:iteration_tokens_total_bucket{le="256.0"}') == 6


def test_a_prefill_step_longer_than_the_bound_keeps_the_worker(server):
    """A prefill of ~1,900 prompt tokens in one step (the CPU's default budget is 8,192 tokens)
    runs past the 2 s heartbeat bound: the worker reads no message meanwhile, but its heartbeat
    thread beats on."""
    old_pid = server.worker_pid()
    prompt = "Quails " + " ".join(f"item{i}" for i in range(520))
    started = time.monotonic()
    reply = httpx.post(server.url + "/v1/completions", timeout=120,
                       json={"model": MODEL, "max_tokens": 1, "prompt": prompt})
    took = time.monotonic() - started
    assert reply.status_code == 200
    assert 1700 < reply.json()["usage"]["prompt_tokens"] < 2040
    assert took > 2.0, f"the prefill took {took:.1f} s: not past the bound, so it proves nothing"
    assert httpx.get(server.url + "/health").status_code == 200
    assert server.worker_pid() == old_pid


def test_a_stopped_worker_is_killed_and_replaced(server):
    old_pid = server.worker_pid()
    time.sleep(3)  # idle past the bound: its beats keep it
    assert httpx.get(server.url + "/health").status_code == 200
    long = {"model": MODEL, "max_tokens": 1500, "ignore_eos": True,
            "messages": [{"role": "user", "content": "Tell a very long story."}]}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json={**long, "stream": True},
                      timeout=60) as response:
        lines = response.iter_lines()
        received = 0
        while received < 3:
            received += next(lines).startswith("data: {")
        os.kill(old_pid, signal.SIGSTOP)
        stopped = time.monotonic()
        rest = [line for line in lines if line]
    ended = time.monotonic() - stopped

    assert 2.0 <= ended < 4.0
    assert rest[-1] == "data: [DONE]"
    error = json.loads(rest[-2].removeprefix("data: "))["error"]
    assert error["code"] == "engine_unavailable" and "silent" in error["message"]
    assert httpx.get(server.url + "/health").status_code == 503
    server.wait_healthy(timeout_s=600)
    assert server.worker_pid() != old_pid
    assert not os.path.exists(f"/proc/{old_pid}")  # killed and reaped, not left stopped
    reply = httpx.post(server.url + "/v1/chat/completions", json={**long, "max_tokens": 4}, timeout=120)
    assert reply.status_code == 200
    assert reply.json()["usage"]["completion_tokens"] == 4
