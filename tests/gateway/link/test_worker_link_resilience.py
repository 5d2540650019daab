"""The remote worker link under attack and under trouble, on loopback against the fake worker:
a stranger without the key, garbage on the inbound port, a paused worker, a vanished one."""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import msgspec
import pytest
import zmq

from fake_worker import FakeWorkerProcess, fake_worker_main
from ports import reserve_ports
from server_helpers import MODEL, server_in_thread
from spillway.gateway.http.app import ServerSettings, build_app
from spillway.gateway.cli.main import main
from spillway.protocol.local import model_files
from spillway.protocol.config import WorkerConfig
from spillway.protocol.local.link_auth import LinkKeys

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Say it."}]}
SECRET = b"correct horse battery staple, twice over"
SCRIPT_TEXT = "Hello world, and more words after it."


@pytest.fixture(scope="module")
def script(files) -> list[int]:
    return model_files.load_tokenizer(files)(SCRIPT_TEXT, add_special_tokens=False)["input_ids"]


@pytest.fixture
def port():
    with reserve_ports(2) as (first, _):
        yield first


def config_of(files) -> WorkerConfig:
    return WorkerConfig(model=str(files.path), served_model_name=MODEL, max_model_len=256)


def start_worker(config: WorkerConfig, port: int, script: list[int], key: bytes | None, step_s: float = 0.002):
    process = multiprocessing.get_context("spawn").Process(
        target=fake_worker_main, daemon=True,
        args=(msgspec.msgpack.encode(config), f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port + 1}",
              script, step_s, 2, 49152, key))
    process.start()
    return process


def gateway(files, port: int, key: bytes | None, **settings):
    return build_app(ServerSettings(
        worker=config_of(files), served_model_names=[MODEL], worker_address=f"tcp://127.0.0.1:{port}",
        worker_keys=LinkKeys.from_secret(key) if key else None, **settings))


def wait_health(url: str, status: int, timeout_s: float) -> float:
    started = time.monotonic()
    while httpx.get(url + "/health").status_code != status:
        assert time.monotonic() - started < timeout_s, f"/health did not turn {status} in {timeout_s} s"
        time.sleep(0.05)
    return time.monotonic() - started


def ask(url: str, max_tokens: int = 3) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", json={**CHAT, "max_tokens": max_tokens}, timeout=20)


def test_strangers_without_the_key_receive_nothing(files, script, port):
    worker = start_worker(config_of(files), port, script, SECRET)
    ctx = zmq.Context()
    plain = ctx.socket(zmq.PULL)  # no CURVE at all
    wrong = ctx.socket(zmq.PULL)  # CURVE with another secret
    LinkKeys.from_secret(b"a different secret of some length").secure_worker_socket(wrong)
    try:
        with server_in_thread(gateway(files, port, SECRET)) as url:
            for stranger in (plain, wrong):
                stranger.setsockopt(zmq.LINGER, 0)
                stranger.connect(f"tcp://127.0.0.1:{port}")
            time.sleep(0.3)  # both have had time to try their handshake
            with ThreadPoolExecutor(8) as pool:
                replies = list(pool.map(lambda _: ask(url), range(8)))
            assert [r.status_code for r in replies] == [200] * 8
            assert {r.json()["choices"][0]["message"]["content"] for r in replies} == {"Hello world,"}
            assert not plain.poll(200) and not wrong.poll(200)
    finally:
        ctx.destroy(linger=0)
        worker.kill()


def test_garbage_on_the_inbound_port_is_dropped_and_the_link_stays(files, script, port, caplog):
    worker = start_worker(config_of(files), port, script, None)
    ctx = zmq.Context()
    pusher = ctx.socket(zmq.PUSH)
    pusher.setsockopt(zmq.LINGER, 1000)
    try:
        with server_in_thread(gateway(files, port, None)) as url:
            assert ask(url).status_code == 200
            caplog.set_level(logging.WARNING, logger="spillway.gateway")
            pusher.connect(f"tcp://127.0.0.1:{port + 1}")
            for junk in (b"\xc1not msgpack", msgspec.msgpack.encode({"type": "Nonsense"}), b""):
                pusher.send(junk)
            time.sleep(1.0)  # the link has read them
            assert httpx.get(url + "/health").status_code == 200
            reply = ask(url)
            assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"] == "Hello world,"
            dropped = [r.getMessage() for r in caplog.records if "bad message" in r.getMessage()]
            assert len(dropped) == 1 and dropped[0].startswith("dropped 1 bad message(s) from the worker (1 in all)")
    finally:
        ctx.destroy(linger=0)
        worker.kill()


def test_a_paused_worker_is_taken_back_once_it_resumes(files, script, port):
    """Paused past the heartbeat (SIGSTOP, as a network partition does), twice: each time the
    request in flight fails, and the same worker is taken back once it runs again."""
    worker = start_worker(config_of(files), port, script, SECRET, step_s=0.02)
    try:
        with server_in_thread(gateway(files, port, SECRET, heartbeat_timeout_s=1.0)) as url:
            assert ask(url).status_code == 200
            for _ in range(2):
                with httpx.stream("POST", url + "/v1/chat/completions",
                                  json={**CHAT, "max_tokens": 200, "stream": True}, timeout=20) as running:
                    lines = running.iter_lines()
                    assert next(lines).startswith("data: ")
                    os.kill(worker.pid, signal.SIGSTOP)
                    rest = [line for line in lines if line]
                assert rest[-1] == "data: [DONE]"
                error = json.loads(rest[-2][len("data: "):])["error"]
                assert error["code"] == "engine_unavailable" and "silent" in error["message"]
                wait_health(url, 503, 5.0)
                time.sleep(1.0)  # paused well past the heartbeat
                os.kill(worker.pid, signal.SIGCONT)
                wait_health(url, 200, 10.0)
                reply = ask(url)
                assert reply.status_code == 200
                assert reply.json()["choices"][0]["message"]["content"] == "Hello world,"
            assert worker.is_alive()  # the same process, taken back
    finally:
        os.kill(worker.pid, signal.SIGCONT)
        worker.kill()


def test_a_request_whose_worker_vanished_ends_within_its_bound(files, script, port):
    worker = start_worker(config_of(files), port, script, SECRET, step_s=0.02)
    try:
        app = gateway(files, port, SECRET, heartbeat_timeout_s=60.0, response_timeout_s=1.0)
        with server_in_thread(app) as url:
            assert ask(url).status_code == 200
            with httpx.stream("POST", url + "/v1/chat/completions",
                              json={**CHAT, "max_tokens": 200, "stream": True}, timeout=20) as running:
                lines = running.iter_lines()
                assert next(lines).startswith("data: ")
                os.kill(worker.pid, signal.SIGSTOP)  # gone without a word; the heartbeat is far off
                stopped = time.monotonic()
                rest = [line for line in lines if line]
                waited = time.monotonic() - stopped
            assert 0.8 <= waited < 2.5  # the bound counts from the last token, just before the pause
            assert rest[-1] == "data: [DONE]"
            error = json.loads(rest[-2][len("data: "):])["error"]
            assert error["code"] == "worker_timeout"
            assert error["message"] == "the request timed out: the worker did not answer this request for 1 s"
            started = time.monotonic()
            reply = ask(url)  # not streamed: the same bound, as a 504
            assert reply.status_code == 504 and reply.json()["error"]["code"] == "worker_timeout"
            assert 1.0 <= time.monotonic() - started < 2.5
    finally:
        os.kill(worker.pid, signal.SIGCONT)
        worker.kill()


def test_the_death_of_a_local_worker_names_its_signal(files, script):
    config = config_of(files)
    launches = []

    def start():
        launches.append(FakeWorkerProcess(config, script, step_s=0.02))
        return launches[-1]

    with server_in_thread(build_app(ServerSettings(worker=config, served_model_names=[MODEL]), start)) as url:
        with httpx.stream("POST", url + "/v1/chat/completions",
                          json={**CHAT, "max_tokens": 200, "stream": True}, timeout=20) as running:
            lines = running.iter_lines()
            assert next(lines).startswith("data: ")
            os.kill(launches[0].process.pid, signal.SIGKILL)
            rest = [line for line in lines if line]
        error = json.loads(rest[-2][len("data: "):])["error"]
        assert error["message"] == ("the request failed because the engine stopped: "
                                    "the worker process was killed by SIGKILL")


@pytest.mark.parametrize("command", [
    ["serve", "--worker-address", "tcp://0.0.0.0:5555"], ["worker", "--connect", "tcp://10.1.2.3:5555"],
])
def test_a_public_link_without_a_key_is_refused_at_start(command, capsys, monkeypatch):
    monkeypatch.delenv("SPILLWAY_WORKER_KEY", raising=False)
    assert main(command) == 1
    assert "is reachable from other hosts: give the same secret to both ends as SPILLWAY_WORKER_KEY or " \
           "--worker-key-file PATH" in capsys.readouterr().err


def test_a_short_worker_key_is_refused_at_start(capsys, monkeypatch):
    monkeypatch.setenv("SPILLWAY_WORKER_KEY", "short")
    assert main(["worker", "--connect", "tcp://10.1.2.3:5555"]) == 1
    assert "the worker key is 5 bytes; it needs at least 16" in capsys.readouterr().err
