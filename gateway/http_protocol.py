"""The server's HTTP/1.1 protocol: uvicorn's httptools protocol with a bound on a request's head.

httptools (llhttp) already refuses the framings that request smuggling relies on: a request
with both Content-Length and Transfer-Encoding, two Content-Lengths, or a Transfer-Encoding that
does not end in `chunked` is answered 400 and its connection closed. It bounds neither the size
of a request's head nor its number of headers, and it accepts codings before `chunked`
(`gzip, chunked`) that nothing here would undo. This protocol adds:

- MAX_HEADER_BYTES for the request target and the headers together (each header counted with
  its `: ` and CRLF); past it a 431 and the connection closes. The parser hands a header over
  only once it ends, so a head is also measured as its bytes arrive: one that has not ended
  within UNFINISHED_HEAD_BYTES is refused the same way, and holds no more memory than that.
- a Transfer-Encoding other than plain `chunked`: 501, and the connection closes.

An ASGI middleware sees neither: it gets a request only once its head is parsed.
"""

from __future__ import annotations

import http
import logging

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

MAX_HEADER_BYTES = 64 << 10
HEADER_FRAMING_BYTES = len(b": \r\n")
UNFINISHED_HEAD_BYTES = 2 * MAX_HEADER_BYTES  # room for the request line's framing and one read
TOO_LARGE = f"the request line and headers exceed {MAX_HEADER_BYTES} bytes"

logger = logging.getLogger("spillway.gateway")


def server_config(app, **options) -> uvicorn.Config:
    """uvicorn's configuration for serving `app` with this protocol; no WebSocket upgrades (the
    API has no WebSocket route, and an upgraded connection would leave the protocol that counts
    it open: gateway/shared_accept.py)."""
    return uvicorn.Config(app, http=BoundedHeadProtocol, ws="none", **options)


class BoundedHeadProtocol(HttpToolsProtocol):
    """HttpToolsProtocol refusing heads over MAX_HEADER_BYTES and transfer codings other than chunked."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = True  # from a message's end (or the connection's start) to its successor's headers' end
        self._head_bytes_read = 0  # read since this head began: its size, plus at most one read's body bytes
        self._head_bytes = 0  # this head's size as parsed so far
        self._refusal: tuple[http.HTTPStatus, str] | None = None

    def data_received(self, data: bytes) -> None:
        if self._in_head:
            self._head_bytes_read += len(data)
        super().data_received(data)
        if self._in_head and self._refusal is None and self._head_bytes_read > UNFINISHED_HEAD_BYTES:
            # A head still unfinished past the limit: one endless header, or endless headers.
            self._refusal = (http.HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, TOO_LARGE)
            self._send_refusal()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_bytes = 0

    def on_url(self, url: bytes) -> None:
        self._count(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value) + HEADER_FRAMING_BYTES)
        if name.lower() == b"transfer-encoding" and value.strip().lower() != b"chunked":
            self._stop(http.HTTPStatus.NOT_IMPLEMENTED, "only the chunked transfer coding is supported")
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._in_head = True
        self._head_bytes_read = 0

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a request the parser gave up on: ours where a callback stopped it."""
        if self._refusal is None:
            super().send_400_response(msg)
        else:
            self._send_refusal()

    def _count(self, num_bytes: int) -> None:
        self._head_bytes += num_bytes
        if self._head_bytes > MAX_HEADER_BYTES:
            self._stop(http.HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, TOO_LARGE)

    def _stop(self, status: http.HTTPStatus, message: str) -> None:
        """Keep the answer and stop the parser, which uvicorn answers through send_400_response."""
        self._refusal = (status, message)
        raise ValueError(message)

    def _send_refusal(self) -> None:
        status, message = self._refusal
        logger.warning("refused a request from %s: %s", self.client, message)
        body = message.encode()
        head = [f"HTTP/1.1 {status.value} {status.phrase}\r\n".encode()]
        head += [name + b": " + value + b"\r\n" for name, value in self.server_state.default_headers]
        head += [b"content-type: text/plain; charset=utf-8\r\n", b"content-length: %d\r\n" % len(body),
                 b"connection: close\r\n\r\n"]
        self.transport.write(b"".join(head) + body)
        self.transport.close()
