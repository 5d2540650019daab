"""The local worker's heartbeat, against the fake worker beating as the real one does: a stopped
worker turns /health to 503, fails its streams, is killed and replaced; a long step does not,
unless it runs past the step bound."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from server_helpers import MODEL, fake_app, server_in_thread
from spillway.gateway.cli.main import _server_settings, build_parser
from spillway.gateway.link.worker_liveness import Liveness
from spillway.protocol.local import model_files

SCRIPT_TEXT = "Hello world, and more words after it."
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Say it."}]}


@pytest.fixture(scope="module")
def script(files) -> list[int]:
    return model_files.load_tokenizer(files)(SCRIPT_TEXT, add_special_tokens=False)["input_ids"]


def wait_for(predicate, timeout_s: float) -> float:
    """Seconds until `predicate()` held, polled every 50 ms; fails past `timeout_s`."""
    started = time.monotonic()
    while not predicate():
        assert time.monotonic() - started < timeout_s, f"not within {timeout_s} s"
        time.sleep(0.05)
    return time.monotonic() - started


def health(url: str) -> int:
    return httpx.get(url + "/health", timeout=5).status_code


def test_a_stopped_worker_turns_health_to_503_fails_its_streams_and_is_replaced(files, script):
    app, launches = fake_app(files, script, step_s=0.05, beat=True, heartbeat_timeout_s=1.0)
    with server_in_thread(app) as url:
        assert health(url) == 200
        time.sleep(1.5)  # idle past the bound: the beats keep it
        assert health(url) == 200 and len(launches) == 1
        old = launches[0].process
        whole: dict[str, httpx.Response] = {}
        waiting = threading.Thread(target=lambda: whole.update(response=httpx.post(
            url + "/v1/chat/completions", json={**CHAT, "max_tokens": 200}, timeout=30)))
        with httpx.stream("POST", url + "/v1/chat/completions", timeout=30,
                          json={**CHAT, "max_tokens": 200, "stream": True}) as response:
            lines = response.iter_lines()
            received = 0
            while received < 3:
                received += next(lines).startswith("data: {")
            waiting.start()
            time.sleep(0.2)  # the non-streaming request is in flight too
            os.kill(old.pid, signal.SIGSTOP)
            stopped = time.monotonic()
            unhealthy_after = wait_for(lambda: health(url) == 503, timeout_s=5.0)
            rest = [line for line in lines if line]
        waiting.join(10)

        assert 1.0 <= unhealthy_after < 2.5  # past the bound, within one watch of it
        assert rest[-1] == "data: [DONE]"
        error = json.loads(rest[-2].removeprefix("data: "))["error"]
        assert error["code"] == "engine_unavailable" and error["type"] == "server_error"
        assert "silent" in error["message"]
        assert whole["response"].status_code == 503
        assert whole["response"].json()["error"]["code"] == "engine_unavailable"
        old.join(5)
        assert old.exitcode == -signal.SIGKILL  # killed, not left stopped

        wait_for(lambda: health(url) == 200, timeout_s=10.0)
        assert len(launches) == 2 and launches[1].process.pid != old.pid
        assert time.monotonic() - stopped < 10.0
        reply = httpx.post(url + "/v1/chat/completions", json={**CHAT, "max_tokens": 4}, timeout=30)
        assert reply.status_code == 200
        assert reply.json()["usage"]["completion_tokens"] == 4


def test_a_long_step_keeps_a_beating_worker_healthy(files, script):
    """The first step holds the worker's loop for 3 s, three times the heartbeat bound: it
    answers no probe meanwhile, but its beats go on, so nothing is lost."""
    app, launches = fake_app(files, script, beat=True, stall_s=3.0, heartbeat_timeout_s=1.0, step_timeout_s=10.0)
    with server_in_thread(app) as url:
        reply: dict[str, httpx.Response] = {}
        asking = threading.Thread(target=lambda: reply.update(response=httpx.post(
            url + "/v1/chat/completions", json={**CHAT, "max_tokens": 5}, timeout=30)))
        started = time.monotonic()
        asking.start()
        statuses = []
        while asking.is_alive():
            statuses.append(health(url))
            time.sleep(0.1)
        asking.join()
        took = time.monotonic() - started

        assert took >= 3.0
        assert set(statuses) == {200} and len(statuses) >= 10  # polled through the whole stall
        assert reply["response"].status_code == 200
        assert reply["response"].json()["usage"]["completion_tokens"] == 5
        assert len(launches) == 1 and launches[0].process.is_alive()


def test_a_step_past_the_step_bound_loses_the_worker(files, script):
    """The first worker's first step runs for 30 s, past the 1.5 s step bound: its request
    fails with the reason, the worker is killed and the next one serves."""
    app, launches = fake_app(files, script, beat=True, stall_s=30.0, heartbeat_timeout_s=5.0, step_timeout_s=1.5)
    with server_in_thread(app) as url:
        started = time.monotonic()
        failed = httpx.post(url + "/v1/chat/completions", json={**CHAT, "max_tokens": 5}, timeout=30)
        took = time.monotonic() - started

        assert 1.5 <= took < 3.0
        assert failed.status_code == 503
        assert "step has run for 2 s, past the step timeout of 1.5 s" in failed.json()["error"]["message"]
        old = launches[0].process
        old.join(5)
        assert old.exitcode == -signal.SIGKILL
        wait_for(lambda: health(url) == 200, timeout_s=10.0)
        assert len(launches) == 2
        reply = httpx.post(url + "/v1/chat/completions", json={**CHAT, "max_tokens": 4}, timeout=30)
        assert reply.status_code == 200
        assert reply.json()["usage"]["completion_tokens"] == 4


def test_the_bounds_are_flags_of_serve_with_defaults_and_positive_values_only(capsys):
    def settings(*flags: str):
        return _server_settings(build_parser().parse_args(["serve", "--load-format", "dummy", *flags]))

    default = settings()
    assert (default.heartbeat_timeout_s, default.step_timeout_s) == (60.0, 600.0)
    given = settings("--worker-heartbeat-timeout", "5", "--worker-step-timeout", "90")
    assert (given.heartbeat_timeout_s, given.step_timeout_s) == (5.0, 90.0)
    for flag in ("--worker-heartbeat-timeout", "--worker-step-timeout"):
        for value in ("0", "-1", "nan"):
            with pytest.raises(SystemExit) as exited:
                build_parser().parse_args(["serve", flag, value])
            assert exited.value.code == 2
            assert flag in capsys.readouterr().err


def test_liveness_loses_a_worker_past_either_bound_and_probes_a_quiet_one_once_a_second():
    liveness = Liveness(heartbeat_timeout_s=2.0, step_timeout_s=5.0)
    liveness.heard(100.0)
    assert [liveness.should_probe(t) for t in (100.5, 100.7, 101.2, 101.9, 102.3)] == [False, True, False, True, False]
    assert liveness.silence(102.0) is None
    assert liveness.silence(102.5) == "the worker has been silent for 2 s, past the heartbeat timeout of 2 s"
    liveness.heard(102.5)
    assert liveness.silence(104.0) is None and not liveness.should_probe(102.9)
    assert liveness.step_overrun(5.0) is None
    assert liveness.step_overrun(5.25) == "the worker's step has run for 5 s, past the step timeout of 5 s"
    unbounded = Liveness(heartbeat_timeout_s=None, step_timeout_s=None)
    assert unbounded.silence(1e9) is None and unbounded.step_overrun(1e9) is None and not unbounded.should_probe(1e9)
