"""`spillway serve` on the real default model with a 2 s heartbeat bound: a stopped worker
(SIGSTOP) turns /health to 503, ends its streams with an error, and is killed and replaced."""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import pytest

from server_helpers import MODEL, real_server

pytestmark = pytest.mark.slow  # starts `spillway serve` with the real default model

@pytest.fixture(scope="module")
def server():
    with real_server("--max-model-len", "2048", "--worker-heartbeat-timeout", "2") as running:
        yield running


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
