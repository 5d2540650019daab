"""Request framing on raw sockets against the server's uvicorn: smuggling framings are refused
and their connections closed, heads are bounded, ordinary keep-alive and pipelining still work."""

from __future__ import annotations

import socket
import time
from urllib.parse import urlsplit

import pytest

from server_helpers import fake_app, server_in_thread
from spillway.gateway.http.http_protocol import MAX_HEADER_BYTES
from spillway.protocol.local import model_files

SMUGGLED = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"


@pytest.fixture(scope="module")
def address():
    files = model_files.resolve_model(None)
    app, _ = fake_app(files, [1, 2])
    with server_in_thread(app) as url:
        parts = urlsplit(url)
        yield parts.hostname, parts.port


def exchange(address, *pieces: bytes, wait_s: float = 2.0) -> tuple[bytes, bool]:
    """Sends `pieces` on one connection; returns what came back and whether the server closed it
    (rather than leaving it open for `wait_s`)."""
    with socket.create_connection(address) as sock:
        for piece in pieces:
            try:
                sock.sendall(piece)
            except (BrokenPipeError, ConnectionResetError):  # closed by the server mid-send
                break
        sock.settimeout(wait_s)
        received = b""
        try:
            while chunk := sock.recv(65536):
                received += chunk
        except TimeoutError:
            return received, False
        except ConnectionResetError:
            pass
        return received, True


def statuses(received: bytes) -> list[int]:
    return [int(line.split()[1]) for line in received.split(b"\r\n") if line.startswith(b"HTTP/1.1 ")]


def post(headers: bytes, body: bytes) -> bytes:
    return b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + headers + b"\r\n" + body


CHUNKED = b"3\r\n{}\n\r\n0\r\n\r\n"


@pytest.mark.parametrize("headers, body", [
    (b"Content-Length: 19\r\nTransfer-Encoding: chunked\r\n", CHUNKED),
    (b"Transfer-Encoding: chunked\r\nContent-Length: 19\r\n", CHUNKED),
    (b"Content-Length: 3\r\nContent-Length: 40\r\n", b"{}\n"),
    (b"Transfer-Encoding: chunked, identity\r\n", CHUNKED),
], ids=["cl-then-te", "te-then-cl", "two-content-lengths", "te-not-ending-chunked"])
def test_ambiguous_framing_is_refused_and_the_connection_closed(address, headers, body):
    received, closed = exchange(address, post(headers, body) + SMUGGLED)
    assert statuses(received) == [400] and closed, received


def test_a_transfer_coding_other_than_chunked_is_refused(address):
    received, closed = exchange(address, post(b"Transfer-Encoding: gzip, chunked\r\n", CHUNKED) + SMUGGLED)
    assert statuses(received) == [501] and closed, received
    assert received.endswith(b"only the chunked transfer coding is supported")


def head_with(header_bytes: int) -> bytes:
    """A GET /health whose request line and headers come to exactly `header_bytes` as counted."""
    start, host = b"/health", b"Host: x\r\n"
    filler = header_bytes - len(start) - len(host) - len(b"X-Fill: \r\n")
    return b"GET " + start + b" HTTP/1.1\r\n" + host + b"X-Fill: " + b"a" * filler + b"\r\n\r\n"


def test_a_head_at_the_limit_is_served_and_one_byte_more_is_431(address):
    received, closed = exchange(address, head_with(MAX_HEADER_BYTES), wait_s=0.5)
    assert statuses(received) == [200] and not closed
    received, closed = exchange(address, head_with(MAX_HEADER_BYTES + 1))
    assert statuses(received) == [431] and closed
    assert received.endswith(f"exceed {MAX_HEADER_BYTES} bytes".encode())


def test_many_small_headers_add_up_to_431(address):
    headers = b"".join(b"X-%d: y\r\n" % i for i in range(MAX_HEADER_BYTES // 8))
    received, closed = exchange(address, b"GET /health HTTP/1.1\r\nHost: x\r\n" + headers + b"\r\n")
    assert statuses(received) == [431] and closed


def test_a_head_that_never_ends_is_cut_off_at_the_limit(address):
    start = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Endless: "
    pieces = [start] + [b"a" * 8192] * (3 * MAX_HEADER_BYTES // 8192)
    started = time.monotonic()
    received, closed = exchange(address, *pieces)
    assert statuses(received) == [431] and closed
    assert time.monotonic() - started < 2.0  # answered at once, not when the client gave up


def test_pipelined_requests_on_one_connection_are_all_served(address):
    big = head_with(MAX_HEADER_BYTES - 100)
    received, closed = exchange(address, big + SMUGGLED + big, wait_s=0.5)
    assert statuses(received) == [200, 200, 200] and not closed
