"""The HTTP gateway against a fake worker (tests/gateway/fake_worker.py) that replays a fixed
token sequence: text handling, limits, auth, worker death and remote workers, in seconds."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import time

import httpx
import msgspec
import pytest

from fake_worker import fake_worker_main
from ports import reserve_ports
from server_helpers import MODEL, fake_app, scrape, server_in_thread, sse_events, worker_config
from spillway.gateway.http.app import ServerSettings, build_app
from spillway.protocol.config import WorkerConfig
from spillway.protocol.local import model_files

MIXED = "Hello 世界! Emoji: 😀👍🏽 and 你好，朋友。 Done."
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Say it."}]}


@pytest.fixture(scope="module")
def script(files) -> list[int]:
    return model_files.load_tokenizer(files)(MIXED, add_special_tokens=False)["input_ids"]


@pytest.fixture(scope="module")
def url(files, script):
    app, _ = fake_app(files, script)
    with server_in_thread(app) as base:
        yield base


def stream_chat(url: str, body: dict) -> list[dict | str]:
    with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}, timeout=30) as r:
        assert r.status_code == 200
        events = sse_events(r.read())
    return [e if e == "[DONE]" else json.loads(e) for e in events]


def test_streamed_chinese_and_emoji_never_show_a_replacement_char(url, script):
    events = stream_chat(url, {**CHAT, "max_tokens": len(script)})
    pieces = [e["choices"][0]["delta"].get("content", "") for e in events[:-1]]
    assert events[-1] == "[DONE]"
    assert all("\ufffd" not in piece for piece in pieces)
    assert "".join(pieces) == MIXED
    whole = httpx.post(url + "/v1/chat/completions", json={**CHAT, "max_tokens": len(script)}).json()
    assert whole["choices"][0]["message"]["content"] == MIXED
    assert whole["usage"]["completion_tokens"] == len(script)


def test_stop_string_split_across_tokens_ends_the_sample(url, script):
    before = scrape(url)['vllm:request_success_total{finished_reason="stop"}']
    events = stream_chat(url, {**CHAT, "max_tokens": 200, "stop": ["朋友"]})
    pieces = [e["choices"][0]["delta"].get("content", "") for e in events[:-1]]
    assert "".join(pieces) == MIXED[:MIXED.index("朋友")]
    assert events[-2]["choices"][0]["finish_reason"] == "stop"
    assert events[-2]["choices"][0]["stop_reason"] == "朋友"
    metrics = scrape(url)
    assert metrics['vllm:request_success_total{finished_reason="stop"}'] == before + 1
    assert metrics["vllm:num_requests_running"] == 0


def test_chat_logprobs_carry_each_tokens_bytes(url, script):
    body = {**CHAT, "max_tokens": len(script), "logprobs": True, "top_logprobs": 2}
    choice = httpx.post(url + "/v1/chat/completions", json=body).json()["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) == len(script)
    assert all(len(entry["top_logprobs"]) == 2 for entry in content)
    assert bytes(b for entry in content for b in entry["bytes"]) == MIXED.encode()


def test_completions_number_choices_prompt_major(url):
    body = {"model": MODEL, "prompt": ["one", "two", "three"], "n": 2, "max_tokens": 3}
    result = httpx.post(url + "/v1/completions", json=body).json()
    assert [c["index"] for c in result["choices"]] == [0, 1, 2, 3, 4, 5]
    assert all(c["text"] == "Hello " and c["finish_reason"] == "length" for c in result["choices"])
    assert result["usage"]["completion_tokens"] == 18


def test_api_key_guards_the_v1_routes(files, script):
    app, _ = fake_app(files, script, api_key="sekrit")
    with server_in_thread(app) as url:
        denied = httpx.get(url + "/v1/models")
        assert denied.status_code == 401
        assert denied.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(url + "/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert httpx.get(url + "/v1/models", headers={"Authorization": "Bearer sekrit"}).status_code == 200
        assert httpx.get(url + "/health").status_code == 200
        assert httpx.post(url + "/invocations", json={**CHAT, "max_tokens": 1}).status_code == 401
        # The scheme in any case (RFC 9110); never another scheme, a prefix or a longer key.
        for header, status in (("bearer sekrit", 200), ("BEARER  sekrit", 200), ("Basic sekrit", 401),
                               ("Bearer sekri", 401), ("Bearer sekrit2", 401), ("sekrit", 401)):
            assert httpx.get(url + "/v1/models", headers={"Authorization": header}).status_code == status, header


def test_ping_and_invocations_as_sagemaker_calls_them(url, script):
    assert httpx.get(url + "/ping").status_code == 200 and httpx.post(url + "/ping").status_code == 200
    chat = httpx.post(url + "/invocations", json={**CHAT, "max_tokens": 3}).json()
    assert chat["object"] == "chat.completion" and chat["usage"]["completion_tokens"] == 3
    text = httpx.post(url + "/invocations", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2}).json()
    assert text["object"] == "text_completion" and text["usage"]["completion_tokens"] == 2
    neither = httpx.post(url + "/invocations", json={"model": MODEL})
    assert neither.status_code == 400 and "needs `messages`" in neither.json()["error"]["message"]
    assert httpx.post(url + "/invocations", content=b"{no", headers={"Content-Type": "application/json"}
                      ).json()["error"]["code"] == "invalid_json"


def test_bodies_that_are_not_json_are_refused_and_min_tokens_must_fit(url):
    body = json.dumps({**CHAT, "max_tokens": 4})
    for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        answer = httpx.post(url + "/v1/chat/completions", content=body, headers={"Content-Type": content_type})
        assert answer.status_code == 415, content_type
        assert answer.json()["error"]["code"] == "unsupported_media_type"
    for content_type in ("application/json; charset=utf-8", "application/vnd.api+json"):
        answer = httpx.post(url + "/v1/chat/completions", content=body, headers={"Content-Type": content_type})
        assert answer.status_code == 200, content_type
    # No max_tokens: the room left in the context (256 here) bounds min_tokens.
    answer = httpx.post(url + "/v1/chat/completions", json={**CHAT, "min_tokens": 10**15})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "min_tokens"
    assert "exceeds the room left" in answer.json()["error"]["message"]


def test_overload_is_answered_with_429_and_retry_after(files, script):
    app, _ = fake_app(files, script, step_s=0.05, max_pending=4)
    with server_in_thread(app) as url:
        with httpx.stream("POST", url + "/v1/chat/completions",
                          json={**CHAT, "n": 3, "max_tokens": 100, "stream": True}) as running:
            lines = running.iter_lines()  # dropping the iterator would close the connection
            next(lines)
            refused = httpx.post(url + "/v1/chat/completions", json={**CHAT, "n": 2, "max_tokens": 2})
            assert refused.status_code == 429
            assert refused.headers["retry-after"] == "1"
            assert refused.json()["error"]["code"] == "overloaded"
        too_big = httpx.post(url + "/v1/chat/completions", json={**CHAT, "n": 5, "max_tokens": 2})
        assert too_big.status_code == 400 and too_big.json()["error"]["param"] == "n"
        deadline = time.monotonic() + 5
        while (ok := httpx.post(url + "/v1/chat/completions", json={**CHAT, "n": 2, "max_tokens": 2})).status_code \
                == 429 and time.monotonic() < deadline:
            time.sleep(0.05)  # the abort of the closed stream is on its way to the worker
        assert ok.status_code == 200


def test_dead_worker_fails_the_stream_at_once_and_is_replaced(files, script):
    app, launches = fake_app(files, script, step_s=0.02, start_delay_s=1.0)
    with server_in_thread(app) as url:
        with httpx.stream("POST", url + "/v1/chat/completions",
                          json={**CHAT, "max_tokens": 200, "stream": True}, timeout=10) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            os.kill(launches[0].process.pid, signal.SIGKILL)
            killed = time.monotonic()
            rest = [line for line in lines if line]
            ended = time.monotonic()
        assert ended - killed < 2.0
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][len("data: "):])["error"]["code"] == "engine_unavailable"
        health = httpx.get(url + "/health")
        assert health.status_code == 503 and health.headers["retry-after"] == "5"
        assert httpx.post(url + "/v1/chat/completions", json={**CHAT, "max_tokens": 2}).status_code == 503
        deadline = time.monotonic() + 30
        while httpx.get(url + "/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert len(launches) == 2
        assert httpx.post(url + "/v1/chat/completions", json={**CHAT, "max_tokens": 2}).status_code == 200


def start_remote_fake(config: WorkerConfig, address_port: int, script: list[int]):
    process = multiprocessing.get_context("spawn").Process(
        target=fake_worker_main, daemon=True,
        args=(msgspec.msgpack.encode(config), f"tcp://127.0.0.1:{address_port}",
              f"tcp://127.0.0.1:{address_port + 1}", script, 0.002, 2, 49152))
    process.start()
    return process


@pytest.fixture
def worker_port():
    """A port for a remote worker's address; it and the next one (the gateway binds both)
    stay reserved for the test, so nothing else takes them before or between gateways."""
    with reserve_ports(2) as (port, _):
        yield port


def remote_gateway(files, port: int, heartbeat_timeout_s: float) -> tuple[WorkerConfig, ServerSettings]:
    """The worker's config, and settings of a gateway waiting for a worker at `port`."""
    config = worker_config(files)
    settings = ServerSettings(worker=config, served_model_names=[MODEL], worker_address=f"tcp://127.0.0.1:{port}",
                              heartbeat_timeout_s=heartbeat_timeout_s)
    return config, settings


def test_remote_worker_over_tcp_is_replaced_when_it_falls_silent(files, script, worker_port):
    config, settings = remote_gateway(files, worker_port, heartbeat_timeout_s=1.5)
    first = start_remote_fake(config, worker_port, script)
    try:
        with server_in_thread(build_app(settings)) as url:
            reply = httpx.post(url + "/v1/chat/completions", json={**CHAT, "max_tokens": 3}).json()
            assert reply["choices"][0]["message"]["content"] == "Hello "
            os.kill(first.pid, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while httpx.get(url + "/health").status_code == 200:
                assert time.monotonic() < deadline
                time.sleep(0.1)
            second = start_remote_fake(config, worker_port, script)
            try:
                deadline = time.monotonic() + 30
                while httpx.get(url + "/health").status_code != 200:
                    assert time.monotonic() < deadline
                    time.sleep(0.1)
                reply = httpx.post(url + "/v1/chat/completions", json={**CHAT, "max_tokens": 3}).json()
                assert reply["choices"][0]["message"]["content"] == "Hello "
            finally:
                second.kill()
    finally:
        first.kill()


# A start that finds the closed gateway's ports still held exits its server thread (uvicorn's
# SystemExit), which the loop below retries: expected, not a failure.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_restarted_gateway_takes_back_a_running_remote_worker(files, script, worker_port):
    """The worker outlives its gateway; the next gateway on the same address attaches to it
    (HELLO -> Ready) instead of waiting for a worker that will never announce itself again."""
    config, settings = remote_gateway(files, worker_port, heartbeat_timeout_s=5.0)
    worker = start_remote_fake(config, worker_port, script)
    try:
        for _ in range(2):  # the first gateway, then its successor
            deadline = time.monotonic() + 20
            while True:  # the closed gateway's ports are released asynchronously
                try:
                    server = server_in_thread(build_app(settings))
                    url = server.__enter__()
                    break
                except RuntimeError:
                    assert time.monotonic() < deadline
                    time.sleep(0.2)
            try:
                reply = httpx.post(url + "/v1/chat/completions", json={**CHAT, "max_tokens": 3}, timeout=10).json()
                assert reply["choices"][0]["message"]["content"] == "Hello "
            finally:
                server.__exit__(None, None, None)
        assert worker.is_alive()
    finally:
        worker.kill()


def test_prompt_token_ids_outside_the_vocabulary_are_refused(url):
    for prompt in ([5, -1], [5, 49152], [[5, 6], [49152]]):
        answer = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 2})
        assert answer.status_code == 400, prompt
        assert answer.json()["error"] == {**answer.json()["error"], "param": "prompt",
                                          "message": "prompt token ids must lie in [0, 49152)"}
    assert httpx.post(url + "/v1/completions", json={"prompt": [0, 49151], "max_tokens": 2}).status_code == 200
