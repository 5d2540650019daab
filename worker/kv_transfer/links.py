"""The KV sockets of one worker process: its KV server when it produces (worker/kv_transfer/server.py)
and, when it consumes, one DEALER per producer it pulls from, connected on the first pull.

    busy loop: take messages (gateway links and these sockets, one poll) -> send_pulls ->
               engine.step() -> take_deltas (requests a failed pull ended) with the step's

Each socket is registered with the busy loop's poller (`watch`) with its handler: a pull reaching
an idle producer is answered at once, and an answer reaching a consumer that waits for it ends
the wait. An answer that does not decode is dropped and logged (rate-limited): its request's pull
then runs past its deadline, where kv_load_failure_policy applies.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import msgspec
import zmq

from spillway.protocol.kv_transfer import KvBlocks, KvPull, kv_link_decoder
from spillway.protocol.local.drop_log import DropLog
from spillway.protocol.local.link_auth import LinkKeyError, LinkKeys, require_key_off_loopback
from spillway.protocol.messages import RequestDelta
from spillway.worker.driver.engine import Engine
from spillway.worker.kv_transfer.server import KvServer

logger = logging.getLogger(__name__)

Watch = Callable[[zmq.Socket, Callable[[], None]], None]


class KvLinks:
    """The engine's KV server and pull sockets. `server_address`: where a producer binds its
    server (None: it does not produce); `keys`: the worker link's, for tcp:// addresses; `watch`:
    registers a socket and its handler with the busy loop's poller (GatewayLinks.watch)."""

    def __init__(self, ctx: zmq.Context, engine: Engine, server_address: str | None, keys: LinkKeys | None,
                 watch: Watch | None = None) -> None:
        self.ctx, self.engine, self.keys = ctx, engine, keys
        self.poller = zmq.Poller()  # every socket here, for `handle` (a loop of its own)
        self._handlers: dict[zmq.Socket, Callable[[], None]] = {}
        self._watch = watch
        self.server = KvServer(ctx, server_address, keys) if server_address is not None else None
        if self.server is not None:
            self._register(self.server.socket, lambda: self.server.serve(engine))
        self._pullers: dict[str, zmq.Socket] = {}  # producer address -> its DEALER
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = kv_link_decoder()
        self._drops = DropLog(logger, "from a KV producer")
        self._deltas: list[RequestDelta] = []

    @property
    def address(self) -> str:
        """The KV server's address ("" when this worker does not produce): Ready.kv_address."""
        return "" if self.server is None else self.server.address

    def _register(self, sock: zmq.Socket, handler: Callable[[], None]) -> None:
        self.poller.register(sock, zmq.POLLIN)
        self._handlers[sock] = handler
        if self._watch is not None:
            self._watch(sock, handler)

    def send_pulls(self) -> None:
        """Send the pulls of the requests the engine held since the last call."""
        for address, pull in self.engine.take_kv_pulls():
            problem = self._send(address, pull)
            if problem is not None:
                self._deltas += self.engine.fail_kv_pull(pull.transfer_id, problem)

    def _send(self, address: str, pull: KvPull) -> str | None:
        """Send `pull` to the producer at `address`; why it could not be sent, or None."""
        sock = self._pullers.get(address)
        if sock is None:
            try:
                sock = self._connect(address)
            except (LinkKeyError, zmq.ZMQError) as exc:
                return f"cannot connect: {exc}"
        try:
            sock.send(self._encoder.encode(pull), zmq.NOBLOCK)
        except zmq.Again:
            return "its queue of pulls is full"
        return None

    def _connect(self, address: str) -> zmq.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            if address.startswith("tcp://"):
                require_key_off_loopback(address, self.keys)  # the prompt's KV is the prompt
                if self.keys is not None:
                    self.keys.secure_worker_socket(sock)
                sock.ipv6 = "[" in address
            sock.connect(address)
        except (LinkKeyError, zmq.ZMQError):
            sock.close(linger=0)
            raise
        self._pullers[address] = sock
        self._register(sock, lambda: self._take_answers(sock))
        return sock

    def _take_answers(self, sock: zmq.Socket) -> None:
        """Hand every answer waiting on `sock` to the engine; never blocks."""
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                answer = self._decoder.decode(frames[0].buffer)
            except msgspec.DecodeError as exc:
                self._drops.drop(f"{len(frames[0])} bytes that do not decode: {exc}")
                continue
            if not isinstance(answer, KvBlocks):
                self._drops.drop(f"a {type(answer).__name__} where an answer was expected")
                continue
            payload = frames[1].buffer if len(frames) == 2 else None
            self._deltas += self.engine.take_kv_blocks(answer, payload)

    def take_deltas(self) -> list[RequestDelta]:
        """The deltas of the requests a pull ended (kv_load_failure_policy "fail") since the last call."""
        deltas, self._deltas = self._deltas, []
        return deltas

    def handle(self, timeout_ms: int) -> bool:
        """Wait up to `timeout_ms` for any of these sockets, then handle all that are ready
        (without a busy loop's poller: tools and tests); whether any was."""
        events = self.poller.poll(timeout_ms)
        for sock, _ in events:
            self._handlers[sock]()
        return bool(events)

    def close(self) -> None:
        for sock in self._handlers:
            sock.close(linger=0)
