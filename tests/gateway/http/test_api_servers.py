"""`spillway serve --api-server-count N`: N processes on one port, one worker. Each server
serves on its own (the other stopped), requests come back to the server that sent them,
/metrics sums every server's counts whichever answers, and the servers start and end as one:
Ctrl-C ends them all and the worker, a server that dies stops the rest with status 1."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from server_helpers import MODEL, ServerProcess, scrape, spillway_command

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"


def children(pid: int) -> list[int]:
    return [int(child) for task in Path(f"/proc/{pid}/task").iterdir()
            for child in (task / "children").read_text().split()]


def api_server_pids(server: ServerProcess) -> list[int]:
    """Server 0's forked API servers: its children that are not the worker."""
    return [pid for pid in children(server.process.pid)
            if b"spillway.worker" not in Path(f"/proc/{pid}/cmdline").read_bytes()]


def complete(url: str, prompt: str, stream: bool = False) -> list[int] | str:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    if not stream:
        reply = httpx.post(url + "/v1/completions", json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        return reply.json()["choices"][0]["text"]
    text = ""
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=120) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                text += httpx.Response(200, content=line[6:]).json()["choices"][0]["text"]
    return text


@pytest.fixture(scope="module")
def two_api_servers():
    """(server, API server 1's pid, the greedy answer to PROMPT) of a served `--api-server-count 2`,
    shared by the tests that leave it serving (a killed worker is replaced)."""
    server = ServerProcess("--api-server-count", "2", "--max-model-len", "512", "--disable-log-stats")
    try:
        server.wait_healthy()
        (other,) = api_server_pids(server)
        yield server, other, complete(server.url, PROMPT)
    finally:
        server.stop()


def served_requests(url: str) -> float:
    return scrape(url)['vllm:request_success_total{finished_reason="length"}']


def test_every_api_server_serves_through_one_worker_and_metrics_sum_across_them(two_api_servers):
    server, other, expected = two_api_servers
    worker, before = server.worker_pid(), scrape(server.url)
    # Each server alone (the other stopped, its connections wait in the shared backlog for
    # whoever accepts): answers through the same worker, the same greedy text.
    for paused in (server.process.pid, other):
        os.kill(paused, signal.SIGSTOP)
        try:
            assert complete(server.url, PROMPT) == expected
            assert complete(server.url, PROMPT, stream=True) == expected
        finally:
            os.kill(paused, signal.SIGCONT)
    # A burst, each request through whichever server accepts it: every answer right.
    with ThreadPoolExecutor(12) as pool:
        answers = list(pool.map(lambda _: complete(server.url, PROMPT), range(12)))
    assert answers == [expected] * 12
    assert server.worker_pid() == worker
    # 2 x 2 + 12 requests more, counted whichever server answers the scrape.
    served_before = before['vllm:request_success_total{finished_reason="length"}']
    assert {served_requests(server.url) for _ in range(6)} == {served_before + 16}
    metrics = scrape(server.url)
    assert metrics["vllm:prompt_tokens_total"] == before["vllm:prompt_tokens_total"] + 16 * 5
    assert metrics["vllm:num_requests_running"] == 0
    assert not any("pid=" in name for name in metrics)  # the single-process series, no pid label
    assert "Traceback" not in server.log()


def test_ctrl_c_ends_every_api_server_and_the_worker():
    server = ServerProcess("--api-server-count", "3", "--max-model-len", "512")
    try:
        server.wait_healthy()
        others, worker = api_server_pids(server), server.worker_pid()
        assert len(others) == 2
        # No server listens before server 0 serves: whichever answered /health, server 0 has said so.
        assert f"Spillway serves {MODEL} at {server.url} with 3 API server processes" in server.log()
        assert server.log().count("worker ready") == 1  # the others' progress lines are not repeated
        complete(server.url, "hi")
        sent = time.monotonic()
        os.killpg(server.process.pid, signal.SIGINT)  # a terminal's Ctrl-C
        code = server.process.wait(30)
        took = time.monotonic() - sent
        log = server.log()
    finally:
        server.stop()
    assert code == 0 and took < 10, log[-3000:]
    assert not any(Path(f"/proc/{pid}").exists() for pid in [*others, worker])
    assert "Traceback" not in log


def test_an_api_server_that_dies_stops_the_others_with_status_1():
    server = ServerProcess("--api-server-count", "2", "--max-model-len", "512")
    try:
        server.wait_healthy()
        (other,) = api_server_pids(server)
        worker = server.worker_pid()
        os.kill(other, signal.SIGKILL)
        code = server.process.wait(30)
        log = server.log()
    finally:
        server.stop()
    assert code == 1, log[-3000:]
    assert "API server 1 was killed by SIGKILL; the server stops" in log
    assert not Path(f"/proc/{worker}").exists()


def test_api_servers_with_a_remote_worker_are_refused():
    result = subprocess.run([*spillway_command(), "serve", "--api-server-count", "2", "--worker-address",
                             "tcp://127.0.0.1:5999"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "--api-server-count 2 with --worker-address: not available yet" in result.stderr


def test_a_killed_worker_is_replaced_for_every_api_server(two_api_servers):
    """Server 0 starts the replacement with every server's link; each server fails what it had
    in flight, takes the new worker (its Ready, a session of its own) and serves again."""
    server, other, expected = two_api_servers
    old_worker = server.worker_pid()
    os.kill(old_worker, signal.SIGKILL)
    deadline = time.monotonic() + 120
    while True:  # the replacement loads: until then each server answers 503
        assert time.monotonic() < deadline, server.log()[-3000:]
        try:
            if server.worker_pid() != old_worker and httpx.get(server.url + "/health", timeout=5).status_code == 200:
                break
        except (AssertionError, httpx.TransportError):
            pass
        time.sleep(0.5)
    # Server 0 stopped: server 1 accepts every connection, through the new worker.
    os.kill(server.process.pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 60
        while True:  # server 1 may still be taking the new worker's Ready
            reply = httpx.post(server.url + "/v1/completions", timeout=60, json={
                "model": MODEL, "prompt": PROMPT, "max_tokens": 6, "temperature": 0,
                "ignore_eos": True})
            if reply.status_code == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    finally:
        os.kill(server.process.pid, signal.SIGCONT)
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["text"] == expected
    assert complete(server.url, PROMPT) == expected
    assert api_server_pids(server) == [other]
