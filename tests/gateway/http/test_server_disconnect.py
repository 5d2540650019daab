"""Clients that go away mid-stream: their requests are aborted in the worker and their KV
blocks freed, with the block manager's invariants intact (SPILLWAY_DEBUG_INVARIANTS=1 makes the
worker check them after every step)."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from server_helpers import MODEL, real_server, scrape

NUM_STREAMS = 20

pytestmark = pytest.mark.slow  # starts `spillway serve` with the real default model


@pytest.fixture(scope="module")
def server():
    with real_server("--max-model-len", "4096") as running:
        yield running


def wait_for(url: str, predicate, timeout_s: float = 30.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        metrics = scrape(url)
        if predicate(metrics) or time.monotonic() > deadline:
            return metrics
        time.sleep(0.1)


def test_cancelled_streams_free_their_blocks(server):
    idle = wait_for(server.url, lambda m: m["vllm:num_requests_running"] == 0)
    idle_usage = idle["vllm:kv_cache_usage_perc"]
    aborted_before = idle['vllm:request_success_total{finished_reason="abort"}']
    worker_pid = server.worker_pid()

    async def stream_then_leave(client: httpx.AsyncClient, index: int, everyone_started: asyncio.Barrier,
                                may_leave: asyncio.Event) -> int:
        body = {"model": MODEL, "max_tokens": 3000, "ignore_eos": True, "stream": True, "seed": index,
                "messages": [{"role": "user", "content": f"Tell a long story about the number {index}."}]}
        received = 0
        async with client.stream("POST", server.url + "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            lines = response.aiter_lines()  # kept: a dropped line iterator closes the connection
            while received < 3:
                received += (await anext(lines)).startswith("data: {")
            await everyone_started.wait()
            await may_leave.wait()
        return received  # leaving the block closes the connection mid-stream

    async def run() -> tuple[list[int], dict[str, float]]:
        barrier, may_leave = asyncio.Barrier(NUM_STREAMS + 1), asyncio.Event()
        async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=NUM_STREAMS)) as client:
            tasks = [asyncio.create_task(stream_then_leave(client, i, barrier, may_leave))
                     for i in range(NUM_STREAMS)]
            await barrier.wait()  # every stream is generating
            busy = await asyncio.to_thread(wait_for, server.url, lambda m: m["vllm:num_requests_running"]
                                           + m["vllm:num_requests_waiting"] == NUM_STREAMS)
            may_leave.set()
            return await asyncio.gather(*tasks), busy

    received, busy = asyncio.run(run())
    assert received == [3] * NUM_STREAMS
    assert busy["vllm:num_requests_running"] + busy["vllm:num_requests_waiting"] == NUM_STREAMS
    assert busy["vllm:kv_cache_usage_perc"] > idle_usage

    after = wait_for(server.url, lambda m: m["vllm:num_requests_running"] == 0
                     and m["vllm:kv_cache_usage_perc"] == idle_usage, timeout_s=15)
    assert after["vllm:num_requests_running"] == 0
    assert after["vllm:num_requests_waiting"] == 0
    assert after["vllm:kv_cache_usage_perc"] == idle_usage
    assert after["spillway:kv_invariants_ok"] == 1
    assert after['vllm:request_success_total{finished_reason="abort"}'] == aborted_before + NUM_STREAMS
    time.sleep(1.0)  # the worker really stopped: no more tokens are generated
    assert scrape(server.url)["vllm:generation_tokens_total"] == after["vllm:generation_tokens_total"]
    assert server.worker_pid() == worker_pid
    reply = httpx.post(server.url + "/v1/chat/completions", timeout=120,
                       json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert reply.status_code == 200


def test_disconnect_during_a_whole_response_aborts_it(server):
    before = scrape(server.url)

    async def leave_early():
        body = {"model": MODEL, "max_tokens": 3000, "ignore_eos": True,
                "messages": [{"role": "user", "content": "Write a very long essay."}]}
        async with httpx.AsyncClient() as client:
            with pytest.raises(httpx.ReadTimeout):
                await client.post(server.url + "/v1/chat/completions", json=body, timeout=3)

    asyncio.run(leave_early())
    after = wait_for(server.url, lambda m: m['vllm:request_success_total{finished_reason="abort"}']
                     == before['vllm:request_success_total{finished_reason="abort"}'] + 1
                     and m["vllm:num_requests_running"] == 0, timeout_s=15)
    assert after['vllm:request_success_total{finished_reason="abort"}'] == \
        before['vllm:request_success_total{finished_reason="abort"}'] + 1
    assert after["vllm:num_requests_running"] == 0
    assert after["vllm:kv_cache_usage_perc"] == before["vllm:kv_cache_usage_perc"]
