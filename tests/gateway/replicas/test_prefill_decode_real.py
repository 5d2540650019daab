"""Disaggregated prefill and decode with real workers of the default model on the CPU: a
producer prefills, the consumer pulls the prompt's blocks from its prefix cache and decodes.

`LLM(prefill_workers=1, decode_workers=1)` generates what `LLM()` does (greedy); `spillway serve
--prefill-workers 1 --decode-workers 1` answers, streamed and whole, as a plain server does, and
counts the bytes moved on both sides alike. Over a server whose clients the test reaches (the
app in this process, its workers real): a client gone during the prefill, the transfer or the
decode leaves both workers' free GPU blocks where they were; a worker killed mid-request ends
that request with an error at once, and the server keeps answering."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time

import httpx
import pytest

from server_helpers import MODEL, engine_values, kill_mid_stream, real_server, server_in_thread
from spillway import LLM, SamplingParams
from spillway.gateway.http.app import ServerSettings, build_app
from spillway.gateway.link.engine_args import engine_config

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("prefill_decode_real")]

PROMPTS = ["Tell me about rivers and the seas they flow into, in one sentence of plain words.",
           "Name three colours of the rainbow and say which one you like best, with a reason.",
           "Hi!",  # shorter than a block: decoded without a prefill
           "Write the first line of a short poem about a lighthouse keeper who counts the waves at night."]


def long_prompt(first: int, length: int = 1500) -> list[int]:
    """`length` token ids, a prefill of many steps at 128 tokens a step; no block of it cached
    anywhere before (its first id is the test's own)."""
    return [first] + list(range(1000, 1000 + length - 1))


GREEDY = {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True}
DEADLINE_S = 60.0


def test_llm_with_prefill_and_decode_workers_generates_what_one_engine_does():
    params = SamplingParams(**GREEDY)
    outputs = {}
    for name, arguments in (("one", {}), ("disaggregated", {"prefill_workers": 1, "decode_workers": 1})):
        llm = LLM(max_model_len=512, **arguments)
        try:
            outputs[name] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
            if name == "disaggregated":
                stats = llm.stats()
        finally:
            llm.shutdown()
    assert outputs["disaggregated"] == outputs["one"] and all(len(ids) == 12 for ids in outputs["one"])
    assert stats.kv_transfer_bytes_received == stats.kv_transfer_bytes_sent > 0  # the two workers' sums


@pytest.fixture(scope="module")
def plain():
    with real_server("--max-model-len", "512") as server:
        yield server


@pytest.fixture(scope="module")
def disaggregated():
    with real_server("--max-model-len", "512", "--prefill-workers", "1", "--decode-workers", "1") as server:
        yield server


def answers(url: str, stream: bool) -> list[tuple[list[int], str]]:
    """(token ids, text) of each prompt's greedy completion."""
    found = []
    for prompt in PROMPTS:
        body = {"model": MODEL, "prompt": prompt, "return_token_ids": True, "stream": stream, **GREEDY}
        if not stream:
            choice = httpx.post(url + "/v1/completions", json=body, timeout=120).json()["choices"][0]
            found.append((choice["token_ids"], choice["text"]))
            continue
        ids, text = [], ""
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as reply:
            for line in reply.iter_lines():
                if line.startswith("data: {"):
                    choice = json.loads(line[len("data: "):])["choices"][0]
                    ids += choice.get("token_ids") or []
                    text += choice["text"]
        found.append((ids, text))
    return found


def test_the_server_answers_streamed_and_whole_as_a_plain_server_does(plain, disaggregated):
    assert httpx.get(disaggregated.url + "/health").json() == {"workers": [
        {"engine": "0", "role": "kv_producer", "state": "ready"},
        {"engine": "1", "role": "kv_consumer", "state": "ready"}]}
    expected = answers(plain.url, stream=False)
    assert all(len(ids) == 12 for ids, _ in expected)
    assert answers(disaggregated.url, stream=False) == expected
    assert answers(disaggregated.url, stream=True) == expected
    deadline = time.monotonic() + 20
    while True:  # the workers' Stats come when they go idle
        moved = engine_values(disaggregated.url, "vllm:kv_transfer_bytes_total")
        if moved[("1", "received")] > 0 and moved[("1", "received")] == moved[("0", "sent")]:
            break
        assert time.monotonic() < deadline, moved
        time.sleep(0.2)
    assert engine_values(disaggregated.url, "vllm:kv_transfer_failures_total") == {("0",): 0, ("1",): 0}


# ---- aborts and lost workers, on the app in this process ------------------------------------


@pytest.fixture(scope="module")
def served():
    """(url, the app's PrefillDecodeSet) over one real producer and one real consumer."""
    config, files = engine_config(None, max_model_len=2048, max_num_batched_tokens=128)
    settings = ServerSettings(worker=config, served_model_names=[MODEL], prefill_workers=1, decode_workers=1,
                              max_pending=64)
    app = build_app(settings)
    with server_in_thread(app, startup_timeout_s=300) as url:
        yield url, app.state.gateway.client


def free_blocks(url: str, workers) -> list[int]:
    """Each worker's free GPU blocks, from fresh Stats (a /metrics scrape asks every worker)."""
    httpx.get(url + "/metrics", timeout=10)
    return [client.last_stats.num_free_gpu_blocks for client in (*workers.producers.replicas,
                                                                 *workers.consumers.replicas)]


def wait_until(condition, timeout_s: float = DEADLINE_S, interval_s: float = 0.005) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(interval_s)


class Streaming:
    """A streamed completion over a socket of the test's own, read by a thread: `close` drops
    the connection at once, whatever the server is doing (a client's read would block until
    the first token)."""

    def __init__(self, url: str, prompt, max_tokens: int = 200) -> None:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
                           "stream": True}).encode()
        self.received = b""
        self._sock = socket.create_connection((host, int(port)))
        self._sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                           b"Content-Length: %d\r\n\r\n" % len(body) + body)
        self._reader = threading.Thread(target=self._read)
        self._reader.start()

    def _read(self) -> None:
        try:
            while chunk := self._sock.recv(65536):
                self.received += chunk
        except OSError:
            pass  # closed by `close`

    @property
    def num_events(self) -> int:
        return self.received.count(b"data: {")

    @property
    def done(self) -> bool:
        return b"data: [DONE]" in self.received

    def close(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        self._reader.join(10)


@pytest.mark.parametrize("stage", ["prefill", "transfer", "decode"])
def test_a_client_gone_at_any_stage_leaves_both_workers_blocks_free(served, stage):
    url, workers = served
    producer, consumer = workers.producers.replicas[0], workers.consumers.replicas[0]
    before = free_blocks(url, workers)
    finished = engine_values(url, "vllm:request_success_total")
    # A long prefill to be caught in; the other stages need only whole blocks to move. Either
    # way, far more tokens asked than could come before the bounds below.
    prompt = long_prompt(1) if stage == "prefill" else long_prompt({"transfer": 2, "decode": 3}[stage], 400)
    stream = Streaming(url, prompt, max_tokens=2040 - len(prompt))
    try:
        if stage == "prefill":
            wait_until(lambda: producer.num_in_flight == 1)
        elif stage == "transfer":  # at the consumer, nothing back yet: pulling, or computing the tail
            wait_until(lambda: consumer.num_in_flight == 1)
            assert stream.num_events == 0
        else:
            wait_until(lambda: stream.num_events >= 3)
    finally:
        stream.close()
    wait_until(lambda: workers.num_in_flight == 0, timeout_s=10)
    wait_until(lambda: free_blocks(url, workers) == before, timeout_s=10, interval_s=0.1)
    ended = {key: value - finished[key] for key, value in engine_values(url, "vllm:request_success_total").items()
             if value != finished[key]}
    assert ended == ({("0", "abort"): 1} if stage == "prefill" else {("0", "length"): 1, ("1", "abort"): 1})


def test_a_producer_killed_mid_prefill_ends_its_request_and_the_consumer_answers_meanwhile(served):
    url, workers = served
    producer = workers.producers.replicas[0]
    stream = Streaming(url, long_prompt(4))
    try:
        wait_until(lambda: producer.num_in_flight == 1)
        os.kill(producer.link.worker_pid, signal.SIGKILL)
        killed = time.monotonic()
        wait_until(lambda: stream.done, timeout_s=10)
        seconds = time.monotonic() - killed
    finally:
        stream.close()
    assert stream.num_events == 1 and b'"error"' in stream.received and b"the prefill worker" in stream.received
    assert seconds < 10
    reply = httpx.post(url + "/v1/completions", timeout=120, json={"model": MODEL, "prompt": PROMPTS[0], **GREEDY})
    assert reply.status_code == 200 and reply.json()["choices"][0]["finish_reason"] == "length"
    wait_until(lambda: workers.producers.healthy, timeout_s=300)


def test_a_consumer_killed_mid_decode_ends_its_request_and_the_server_answers_once_it_is_back(served):
    url, workers = served
    consumer = workers.consumers.replicas[0]
    body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 200, "ignore_eos": True}
    rest, seconds = kill_mid_stream(url, "/v1/completions", body, lambda: consumer.link.worker_pid)
    assert any('"error"' in line and "decode worker" in line for line in rest) and rest[-1] == "data: [DONE]"
    assert seconds < 10
    wait_until(lambda: httpx.get(url + "/health").status_code == 200, timeout_s=300)
    reply = httpx.post(url + "/v1/completions", timeout=120, json={"model": MODEL, "prompt": PROMPTS[0], **GREEDY})
    assert reply.status_code == 200 and len(reply.json()["choices"][0]["text"]) > 0
