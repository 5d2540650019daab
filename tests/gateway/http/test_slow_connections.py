"""Slow clients against `spillway serve`'s server (a fake worker behind it): heads and bodies
trickled a byte a second are cut by `--timeout-request-head` / `--timeout-request-body` with a
408, an idle connection by `--timeout-keep-alive` (or, before its first byte, the head's
timeout), while a slow but steady streamed response outlives all three."""

from __future__ import annotations

import json
import selectors
import socket
import time

import httpx
import pytest

from fake_serve import serving
from server_helpers import MODEL

NUM_SLOW = 200
SLOW_HEAD = (b"", b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 64)  # sent at once, then trickled
SLOW_BODY = (b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 64\r\n\r\n",
             b'{"model": "m", "prompt": "' + b"a" * 64)


def trickle(address, count: int, opening: bytes, trickled: bytes, interval_s: float, for_s: float):
    """`count` connections that each send `opening`, then one byte of `trickled` every
    `interval_s`, for `for_s` at most; for each, what came back and the seconds after its
    connect that the server closed it (None if it stayed open)."""
    selector = selectors.DefaultSelector()
    opened, received, closed_after = {}, {}, {}
    for _ in range(count):
        sock = socket.create_connection(address)
        opened[sock], received[sock], closed_after[sock] = time.monotonic(), b"", None
        sock.sendall(opening)
        sock.setblocking(False)
        selector.register(sock, selectors.EVENT_READ)
    start, sent = time.monotonic(), 0
    while time.monotonic() - start < for_s and any(after is None for after in closed_after.values()):
        if sent < len(trickled) and time.monotonic() - start >= sent * interval_s:
            for sock, after in closed_after.items():
                if after is None:
                    try:
                        sock.send(trickled[sent:sent + 1])
                    except OSError:  # closed by the server: its answer is read below
                        pass
            sent += 1
        for key, _ in selector.select(timeout=0.02):
            sock = key.fileobj
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                chunk = b""
            received[sock] += chunk
            if not chunk:
                closed_after[sock] = time.monotonic() - opened[sock]
                selector.unregister(sock)
    for sock in opened:
        sock.close()
    return [(received[sock], closed_after[sock]) for sock in opened]


@pytest.mark.parametrize("opening, trickled, flag", [
    (*SLOW_HEAD, "--timeout-request-head"), (*SLOW_BODY, "--timeout-request-body"),
], ids=["head", "body"])
def test_a_slowloris_of_200_connections_is_cut_by_the_read_timeout(opening, trickled, flag):
    """Without the timeouts every one of them stays open as long as it trickles."""
    with serving(flag, "2") as address:
        outcome = trickle(address, NUM_SLOW, opening, trickled, interval_s=1.0, for_s=8)
    assert sum(after is not None for _, after in outcome) == NUM_SLOW
    for received, after in outcome:
        assert received.startswith(b"HTTP/1.1 408 Request Timeout\r\n"), received
        assert received.endswith(f"did not arrive within 2 s".encode()), received
        assert 1.9 <= after <= 4.0, after


def exchange_then_wait(address, request: bytes, wait_s: float) -> tuple[bytes, float | None]:
    """Sends `request` (if any) on a new connection and reads until the server closes it; what
    came back, and the seconds from the last byte received (or the connect) to the close."""
    with socket.create_connection(address) as sock:
        sock.sendall(request)
        sock.settimeout(wait_s)
        received, last = b"", time.monotonic()
        try:
            while chunk := sock.recv(65536):
                received, last = received + chunk, time.monotonic()
        except TimeoutError:
            return received, None
        return received, time.monotonic() - last


def test_an_idle_keep_alive_connection_is_closed_after_the_keep_alive_timeout():
    with serving("--timeout-keep-alive", "1") as address:
        received, idle_s = exchange_then_wait(address, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n", wait_s=5)
    assert received.startswith(b"HTTP/1.1 200 OK\r\n"), received
    assert idle_s is not None and 0.9 <= idle_s <= 2.0, idle_s


def test_a_connection_that_sends_nothing_is_closed_after_the_head_timeout():
    with serving("--timeout-request-head", "1") as address:
        received, idle_s = exchange_then_wait(address, b"", wait_s=5)
    assert received == b""  # nothing of a head came: nothing to answer
    assert idle_s is not None and 0.9 <= idle_s <= 2.0, idle_s


def test_a_slow_steady_stream_outlives_every_read_timeout():
    """40 tokens 75 ms apart (3 s) under 1 s timeouts: only reads from the client are timed."""
    num_tokens, step_s = 40, 0.075
    flags = ("--timeout-keep-alive", "1", "--timeout-request-head", "1", "--timeout-request-body", "1")
    with serving(*flags, script=range(100, 100 + num_tokens), step_s=step_s) as (host, port):
        started = time.monotonic()
        body = {"model": MODEL, "prompt": "Count.", "max_tokens": num_tokens, "stream": True,
                "stream_options": {"include_usage": True}}
        with httpx.stream("POST", f"http://{host}:{port}/v1/completions", json=body, timeout=30) as response:
            assert response.status_code == 200
            events = [line[len("data: "):] for line in response.iter_lines() if line]
        took_s = time.monotonic() - started
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert chunks[-1]["usage"]["completion_tokens"] == num_tokens
    assert [choice["finish_reason"] for chunk in chunks for choice in chunk["choices"]
            if choice["finish_reason"]] == ["length"]
    assert took_s >= 0.9 * num_tokens * step_s, took_s
