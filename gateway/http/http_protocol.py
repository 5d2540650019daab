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
- read timeouts, since uvicorn times only the idle keep-alive wait after a response
  (`timeout_keep_alive`): a request's head must arrive whole within `timeout_request_head` of
  the connection's start or of its first byte (a later request's), its body within
  `timeout_request_body` of the head's end; past either a 408 (the connection closes silently
  if nothing of the head came). Only reads from the client are timed: a long response is not.
- with `bound` (set by the accepting server, gateway/http/shared_accept.py) it tells the bound when
  it waits for a head and when it is busy, and closes when the bound needs its room (a 503 if
  part of a head came).

An ASGI middleware sees none of this: it gets a request only once its head is parsed.
"""

from __future__ import annotations

import asyncio
import http
import logging

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from spillway.gateway.http.connection_bound import ConnectionBound

MAX_HEADER_BYTES = 64 << 10
HEADER_FRAMING_BYTES = len(b": \r\n")
UNFINISHED_HEAD_BYTES = 2 * MAX_HEADER_BYTES  # room for the request line's framing and one read
TOO_LARGE = f"the request line and headers exceed {MAX_HEADER_BYTES} bytes"
DEFAULT_TIMEOUT_KEEP_ALIVE_S = 5.0  # vLLM's and uvicorn's
# A head is a few hundred bytes in one packet; 20 s leaves room for a slow or lossy link.
DEFAULT_TIMEOUT_REQUEST_HEAD_S = 20.0
# A body of --max-request-body-bytes' default (8 MiB) arrives in 60 s at 1.2 Mbit/s.
DEFAULT_TIMEOUT_REQUEST_BODY_S = 60.0

logger = logging.getLogger("spillway.gateway")


class ServerConfig(uvicorn.Config):
    """uvicorn's configuration, with the seconds a request's head and its body may take to arrive."""

    def __init__(self, app, *, timeout_request_head: float = DEFAULT_TIMEOUT_REQUEST_HEAD_S,
                 timeout_request_body: float = DEFAULT_TIMEOUT_REQUEST_BODY_S, **options) -> None:
        super().__init__(app, **options)
        self.timeout_request_head = timeout_request_head
        self.timeout_request_body = timeout_request_body


def server_config(app, **options) -> ServerConfig:
    """uvicorn's configuration for serving `app` with this protocol; no WebSocket upgrades (the
    API has no WebSocket route, and an upgraded connection would leave the protocol that counts
    it open: gateway/http/shared_accept.py)."""
    options.setdefault("timeout_keep_alive", DEFAULT_TIMEOUT_KEEP_ALIVE_S)
    return ServerConfig(app, http=BoundedHeadProtocol, ws="none", **options)


class BoundedHeadProtocol(HttpToolsProtocol):
    """HttpToolsProtocol refusing heads over MAX_HEADER_BYTES and transfer codings other than
    chunked, and closing connections whose head or body arrives too slowly."""

    bound: ConnectionBound | None = None  # the process's held connections, where it keeps a bound

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = True  # from a message's end (or the connection's start) to its successor's headers' end
        self._head_bytes_read = 0  # read since this head began: its size, plus at most one read's body bytes
        self._head_bytes = 0  # this head's size as parsed so far
        self._refusal: tuple[http.HTTPStatus, str] | None = None
        self._read_deadline: asyncio.TimerHandle | None = None  # the head's or the body's, while one is read

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._time_read(self.config.timeout_request_head, self._head_timed_out)
        if self.bound is not None:
            self.bound.waiting(self)

    def connection_lost(self, exc) -> None:
        self._stop_read_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._in_head:
            if self._read_deadline is None:  # a later request's head begins
                self._time_read(self.config.timeout_request_head, self._head_timed_out)
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
        self._time_read(self.config.timeout_request_body, self._body_timed_out)
        if self.bound is not None:
            self.bound.busy(self)
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._stop_read_timer()
        self._in_head = True
        self._head_bytes_read = 0

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.bound is not None and self.timeout_keep_alive_task is not None:  # idle until the next head
            self.bound.waiting(self)

    def evict(self) -> None:
        """Close to make room for a new connection (the bound's choice: this one has waited longest)."""
        if not self.transport.is_closing():
            self._close_reading(http.HTTPStatus.SERVICE_UNAVAILABLE,
                                "the server holds as many connections as it can; this one waited longest "
                                "for a request", answer=self._head_bytes_read > 0)

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

    def _time_read(self, timeout_s: float, on_timeout) -> None:
        self._stop_read_timer()
        self._read_deadline = self.loop.call_later(timeout_s, on_timeout)

    def _stop_read_timer(self) -> None:
        if self._read_deadline is not None:
            self._read_deadline.cancel()
            self._read_deadline = None

    def _head_timed_out(self) -> None:
        self._read_deadline = None
        if self.transport.is_closing():
            return
        logger.debug("closing a connection from %s: no whole request head within %g s", self.client,
                     self.config.timeout_request_head)
        # A 408 where a head began and nothing else is being answered on the connection.
        quiet = not self.pipeline and (self.cycle is None or self.cycle.response_complete)
        self._close_reading(http.HTTPStatus.REQUEST_TIMEOUT,
                            f"the request's head did not arrive within {self.config.timeout_request_head:g} s",
                            answer=quiet and self._head_bytes_read > 0)

    def _body_timed_out(self) -> None:
        self._read_deadline = None
        if self.transport.is_closing():
            return
        logger.debug("closing a connection from %s: no whole request body within %g s", self.client,
                     self.config.timeout_request_body)
        answer = not self.pipeline and self.cycle is not None and not self.cycle.response_started
        self._close_reading(http.HTTPStatus.REQUEST_TIMEOUT,
                            f"the request's body did not arrive within {self.config.timeout_request_body:g} s",
                            answer=answer)

    def _close_reading(self, status: http.HTTPStatus, message: str, answer: bool) -> None:
        """Close the connection, with `status` as its answer if `answer`; the request being read,
        if any, sees a disconnect from now on and sends nothing."""
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.disconnected = True
            self.cycle.message_event.set()
        if answer:
            self._answer_and_close(status, message)
        else:
            self.transport.close()

    def _send_refusal(self) -> None:
        status, message = self._refusal
        logger.warning("refused a request from %s: %s", self.client, message)
        self._answer_and_close(status, message)

    def _answer_and_close(self, status: http.HTTPStatus, message: str) -> None:
        body = message.encode()
        head = [f"HTTP/1.1 {status.value} {status.phrase}\r\n".encode()]
        head += [name + b": " + value + b"\r\n" for name, value in self.server_state.default_headers]
        head += [b"content-type: text/plain; charset=utf-8\r\n", b"content-length: %d\r\n" % len(body),
                 b"connection: close\r\n\r\n"]
        self.transport.write(b"".join(head) + body)
        self.transport.close()
