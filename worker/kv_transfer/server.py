"""A producer's KV server: a ROUTER that answers each consumer's pull with the blocks it holds.

    consumer DEALER ── [KvPull] ──▶ ROUTER [identity, KvPull]
                    ◀── [KvBlocks, payload] ── [identity, KvBlocks, payload]

A pull is answered between two steps, when the busy loop polls (the server's socket is polled
with the gateway links, so an idle worker answers at once). Over tcp:// the server is keyed as
the gateway's side of a worker link is (CURVE, protocol/local/link_auth.py: every worker holding
the secret may pull) and refused off loopback without a key; over ipc:// it lives in the gateway's
0700 folder. A pull that does not decode is answered with `KvBlocks.error` (the sender's identity
is always known on a ROUTER) and logged, rate-limited.
"""

from __future__ import annotations

import logging
import time

import msgspec
import zmq

from spillway.protocol.kv_transfer import KvPull, kv_link_decoder
from spillway.protocol.local.drop_log import DropLog
from spillway.protocol.local.link_auth import LinkKeys, require_key_off_loopback
from spillway.worker.driver.engine import Engine

logger = logging.getLogger(__name__)


class KvServer:
    """The bound ROUTER of a producer, and the answering of its pulls."""

    def __init__(self, ctx: zmq.Context, address: str, keys: LinkKeys | None) -> None:
        """`address`: where to bind (worker/kv_transfer/setup.py); `keys`: the worker link's,
        for a tcp:// address. LinkKeyError for a tcp:// address off loopback without keys."""
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        if address.startswith("tcp://"):
            require_key_off_loopback(address, keys)
            if keys is not None:
                keys.secure_gateway_socket(sock)
            sock.ipv6 = "[" in address
        sock.bind(address)
        self.socket = sock
        self.address = sock.last_endpoint.decode()  # with the port the system picked, if it did
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = kv_link_decoder()
        self._drops = DropLog(logger, "from a KV consumer")

    def serve(self, engine: Engine) -> None:
        """Answer every pull waiting; never blocks."""
        while True:
            try:
                frames = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._answer(engine, frames)

    def _answer(self, engine: Engine, frames: list[bytes]) -> None:
        started = time.perf_counter()
        identity, body = frames[0], frames[1:]
        pull, problem = None, None
        if len(body) != 1:
            problem = f"a pull of {len(body)} frames, not 1"
        else:
            try:
                pull = self._decoder.decode(body[0])
            except msgspec.DecodeError as exc:
                problem = f"a pull of {len(body[0])} bytes that does not decode: {exc}"
            else:
                if not isinstance(pull, KvPull):
                    problem = f"a {type(pull).__name__} where a pull was expected"
        if problem is not None:
            self._drops.drop(problem)
            answer, payload = engine.kv_refusal("", problem), memoryview(b"")
        else:
            answer, payload = engine.serve_kv_pull(pull)
            payload = memoryview(payload)
        # The payload is not copied: ZeroMQ holds it (and the host memory under it) until sent.
        # That memory is the answer's own, not a slot of either KV pool, which steps may reuse.
        self.socket.send_multipart([identity, self._encoder.encode(answer), payload], copy=False)
        engine.kv_counters.sent(payload.nbytes, time.perf_counter() - started)

    def close(self) -> None:
        self.socket.close(linger=0)
