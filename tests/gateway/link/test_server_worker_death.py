"""The worker process is killed mid-stream: in-flight requests end with an error at once,
/health says 503 while a new worker loads, then the server recovers."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from server_helpers import MODEL, kill_mid_stream, real_server

pytestmark = pytest.mark.slow  # starts `spillway serve` with the real default model

LONG = {"model": MODEL, "max_tokens": 3000, "ignore_eos": True,
        "messages": [{"role": "user", "content": "Tell a very long story."}]}


@pytest.fixture(scope="module")
def server():
    with real_server("--max-model-len", "4096") as running:
        yield running


def test_killed_worker_fails_in_flight_requests_and_is_replaced(server):
    old_pid = server.worker_pid()
    whole: dict[str, httpx.Response] = {}
    waiting = threading.Thread(target=lambda: whole.update(
        response=httpx.post(server.url + "/v1/chat/completions", json=LONG, timeout=120)))
    waiting.start()
    rest, stream_ended = kill_mid_stream(server.url, "/v1/chat/completions", LONG, lambda: old_pid)
    killed = time.monotonic() - stream_ended
    waiting.join(30)
    whole_ended = time.monotonic() - killed

    assert stream_ended < 3.0
    assert rest[-1] == "data: [DONE]"
    error = json.loads(rest[-2][len("data: "):])["error"]
    assert error["code"] == "engine_unavailable" and error["type"] == "server_error"
    assert whole_ended < 3.0
    assert whole["response"].status_code == 503
    assert whole["response"].json()["error"]["code"] == "engine_unavailable"

    health = httpx.get(server.url + "/health")
    assert health.status_code == 503
    assert health.headers["retry-after"]
    refused = httpx.post(server.url + "/v1/chat/completions", json={**LONG, "max_tokens": 2})
    assert refused.status_code == 503 and refused.headers["retry-after"]

    server.wait_healthy(timeout_s=600)
    assert server.worker_pid() != old_pid
    reply = httpx.post(server.url + "/v1/chat/completions", json={**LONG, "max_tokens": 4}, timeout=120)
    assert reply.status_code == 200
    assert reply.json()["usage"]["completion_tokens"] == 4
