"""Disaggregated prefill and decode through the HTTP server, over fake workers that record what
they take (tests/gateway/fake_worker.py): `--prefill-workers 1 --decode-workers 1` answers from
the consumer, lists its workers' roles on /health and exports the KV transfer counters by
direction and engine; a producer killed mid-prefill ends the stream with an error and the server
keeps answering. vLLM's two-server form: a kv_producer server answers `do_remote_decode` with its
worker's KV address, a kv_consumer server hands `remote_address` to its worker, a proxy copying
one into the other joins them; every malformed or misplaced `kv_transfer_params` is a 400."""

from __future__ import annotations

import os
import signal
import threading
import time
from contextlib import contextmanager

import httpx
import pytest

from fake_worker import KV_BLOCK_BYTES, FakeWorkerProcess, fake_kv_address, recorded
from server_helpers import MODEL, engine_values, server_in_thread
from spillway.gateway.http.app import ServerSettings, build_app
from spillway.protocol.config import WorkerConfig
from spillway.protocol.kv_transfer import KvTransferConfig
from spillway.protocol.local import model_files

SCRIPT = list(range(100, 164))
PROMPT = list(range(1000, 1000 + 16 * 3 + 2))  # three whole blocks and a tail
CONSUMER_ADDRESS = "tcp://127.0.0.1:5599"  # a KV server's address as a prefill server's answer gives it


def _config(role: str | None = None) -> WorkerConfig:
    kv = KvTransferConfig(kv_connector="HostConnector", kv_role=role) if role else None
    return WorkerConfig(model=str(model_files.resolve_model(None).path), served_model_name=MODEL, max_model_len=512,
                        kv_transfer=kv)


@contextmanager
def disaggregated_server(tmp_path, prefill_hold_s: float = 0.0):
    """A server with one fake producer and one fake consumer; (url, app, record files)."""
    files = [tmp_path / "prefill", tmp_path / "decode"]
    configs = [_config("kv_producer"), _config("kv_consumer")]
    holds = [prefill_hold_s, 0.0]
    started = [0, 0]

    def start(k: int) -> FakeWorkerProcess:  # a replacement does not hold
        started[k] += 1
        return FakeWorkerProcess(configs[k], SCRIPT, hold_s=holds[k] if started[k] == 1 else 0.0, beat=True,
                                 record_path=str(files[k]))

    starts = [lambda k=k: start(k) for k in range(2)]
    settings = ServerSettings(worker=_config(), served_model_names=[MODEL], prefill_workers=1, decode_workers=1)
    app = build_app(settings, starts)
    with server_in_thread(app) as url:
        yield url, app, files


@contextmanager
def role_server(tmp_path, role: str | None, name: str):
    """A server of one fake worker in `role` (the two-server form); (url, its record file)."""
    record = tmp_path / name
    settings = ServerSettings(worker=_config(role), served_model_names=[MODEL])
    app = build_app(settings, lambda: FakeWorkerProcess(_config(role), SCRIPT, record_path=str(record)))
    with server_in_thread(app) as url:
        yield url, record, app


def post(url: str, body: dict, path: str = "/v1/completions") -> httpx.Response:
    return httpx.post(url + path, json={"model": MODEL, "max_tokens": 4, **body}, timeout=30)


def test_prefill_and_decode_workers_answer_from_the_consumer(tmp_path):
    with disaggregated_server(tmp_path) as (url, app, files):
        assert httpx.get(url + "/health").json() == {"workers": [
            {"engine": "0", "role": "kv_producer", "state": "ready"},
            {"engine": "1", "role": "kv_consumer", "state": "ready"}]}
        whole = post(url, {"prompt": PROMPT, "return_token_ids": True}).json()
        with httpx.stream("POST", url + "/v1/completions", timeout=30, json={
                "model": MODEL, "prompt": PROMPT, "max_tokens": 4, "stream": True, "return_token_ids": True}) as reply:
            events = [line for line in reply.iter_lines() if line.startswith("data: {")]
        assert whole["choices"][0]["token_ids"] == SCRIPT[:4] and whole["usage"]["completion_tokens"] == 4
        assert whole["choices"][0]["finish_reason"] == "length" and "kv_transfer_params" not in whole
        assert len(events) >= 2 and '"finish_reason":"length"' in events[-1]
        producer_pid = app.state.gateway.client.producers.replicas[0].link.worker_pid
        assert [d["generate"].endswith("-prefill") for d in recorded(files[0])] == [True, True]
        assert {d["kv_source"] for d in recorded(files[1])} == {fake_kv_address(producer_pid)}
        deadline = time.monotonic() + 10
        while engine_values(url, "vllm:kv_transfer_bytes_total").get(("1", "received"), 0) == 0:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        moved = 2 * 3 * KV_BLOCK_BYTES  # two requests of three blocks, each way
        assert engine_values(url, "vllm:kv_transfer_bytes_total") == {
            ("0", "received"): 0, ("0", "sent"): moved, ("1", "received"): moved, ("1", "sent"): 0}
        seconds = engine_values(url, "vllm:kv_transfer_seconds_total")
        assert seconds[("1", "received")] == pytest.approx(moved / 1e9) and seconds[("0", "received")] == 0
        assert engine_values(url, "vllm:kv_transfer_failures_total") == {("0",): 0, ("1",): 0}
        assert post(url, {"prompt": PROMPT, "kv_transfer_params": {"do_remote_decode": True}}).status_code == 400


def test_a_producer_killed_mid_prefill_ends_the_stream_with_an_error_and_the_server_keeps_answering(tmp_path):
    with disaggregated_server(tmp_path, prefill_hold_s=30.0) as (url, app, files):
        lines = []

        def stream():
            with httpx.stream("POST", url + "/v1/completions", timeout=60, json={
                    "model": MODEL, "prompt": PROMPT, "max_tokens": 4, "stream": True}) as reply:
                lines.extend(line for line in reply.iter_lines() if line)

        thread = threading.Thread(target=stream)
        thread.start()
        deadline = time.monotonic() + 10
        while not recorded(files[0]):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        os.kill(app.state.gateway.client.producers.replicas[0].link.worker_pid, signal.SIGKILL)
        thread.join(10)
        assert not thread.is_alive()
        assert '"error"' in lines[-2] and "prefill worker" in lines[-2] and lines[-1] == "data: [DONE]"
        # No decode went out; the consumer only heard that the producer was lost.
        assert [entry for entry in recorded(files[1]) if "kv_source_lost" not in entry] == []
        # The consumer computes prompts while the producer restarts, the new producer does not
        # hold: either way the next request is answered.
        assert post(url, {"prompt": PROMPT}).json()["choices"][0]["finish_reason"] == "length"


def test_two_servers_joined_by_a_proxy_copying_kv_transfer_params(tmp_path):
    with role_server(tmp_path, "kv_producer", "prefill") as (prefill_url, prefill_record, prefill_app), \
            role_server(tmp_path, "kv_consumer", "decode") as (decode_url, decode_record, _):
        producer_pid = prefill_app.state.gateway.client.link.worker_pid
        for path, body in (("/v1/completions", {"prompt": PROMPT}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello there"}]})):
            # vLLM's proxy: the prefill request asks for one token and a remote decode.
            prefill = post(prefill_url, {**body, "max_tokens": 1, "kv_transfer_params": {
                "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                "remote_block_ids": None, "remote_host": None, "remote_port": None}}, path)
            assert prefill.status_code == 200, prefill.text
            params = prefill.json()["kv_transfer_params"]
            assert params == {"remote_address": fake_kv_address(producer_pid), "do_remote_prefill": True}
            decode = post(decode_url, {**body, "kv_transfer_params": params}, path)
            assert decode.status_code == 200, decode.text
            assert decode.json()["usage"]["completion_tokens"] == 4 and "kv_transfer_params" not in decode.json()
    assert [d["kv_source"] for d in recorded(prefill_record)] == [None, None]
    assert [d["kv_source"] for d in recorded(decode_record)] == [fake_kv_address(producer_pid)] * 2


def test_a_decode_server_hands_the_remote_address_to_its_worker(tmp_path):
    with role_server(tmp_path, "kv_both", "both") as (url, record, _):
        reply = post(url, {"prompt": PROMPT, "kv_transfer_params": {"do_remote_prefill": True,
                                                                     "remote_address": CONSUMER_ADDRESS}})
        assert reply.status_code == 200, reply.text
        plain = post(url, {"prompt": PROMPT})  # no kv_transfer_params: a whole request, as any engine's
        assert plain.status_code == 200
    assert [d["kv_source"] for d in recorded(record)] == [CONSUMER_ADDRESS, None]


REFUSALS = [
    (None, {"do_remote_decode": True}, "has no KV transfer role"),
    (None, {"do_remote_prefill": True, "remote_address": CONSUMER_ADDRESS}, "has no KV transfer role"),
    ("kv_consumer", {"do_remote_decode": True}, "has the role kv_consumer"),
    ("kv_producer", {"do_remote_prefill": True, "remote_address": CONSUMER_ADDRESS}, "has the role kv_producer"),
    ("kv_both", {"do_remote_decode": True, "do_remote_prefill": True}, "exclude each other"),
    ("kv_both", {"do_remote_prefill": True}, "needs remote_address"),
    ("kv_both", {"do_remote_prefill": True, "remote_address": "localhost:5599"}, "tcp://HOST:PORT"),
    ("kv_both", {"do_remote_prefill": True, "remote_address": 5599}, "needs remote_address"),
    ("kv_both", {"remote_address": CONSUMER_ADDRESS}, 'needs "do_remote_prefill": true'),
    ("kv_both", {"do_remote_decode": "yes"}, "must be true or false"),
    ("kv_both", {"do_remote_decode": True, "remote_bloc_ids": []}, "unknown key 'remote_bloc_ids'"),
]


@pytest.mark.parametrize("role", [None, "kv_consumer", "kv_producer", "kv_both"])
def test_misplaced_or_malformed_kv_transfer_params_are_refused(tmp_path, role):
    rows = [(params, why) for row_role, params, why in REFUSALS if row_role == role]
    with role_server(tmp_path, role, "worker") as (url, record, _):
        for path, body in (("/v1/completions", {"prompt": PROMPT}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})):
            for params, why in rows:
                reply = post(url, {**body, "kv_transfer_params": params}, path)
                assert reply.status_code == 400, (params, reply.text)
                error = reply.json()["error"]
                assert error["param"] == "kv_transfer_params" and why in error["message"], (params, error)
            assert post(url, {**body, "kv_transfer_params": {}}, path).status_code == 200  # asks for nothing
    assert len(recorded(record)) == 2  # only the requests that asked for nothing reached the worker
