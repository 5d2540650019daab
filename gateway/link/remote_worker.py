"""A worker on another host: `spillway worker MODEL --connect tcp://GATEWAY:PORT`.

The gateway binds two TCP ports and the worker connects to both, as a local worker does over
ipc: PORT carries gateway -> worker (Generate | Abort | Control), PORT+1 worker -> gateway.
With a worker key both sockets are CURVE servers (protocol/local/link_auth.py): a peer without the
key completes no handshake, so it neither reads prompts nor pushes messages. Without one (only
on loopback addresses) anyone on this host can do both.

The gateway cannot start or restart a remote worker; run it under a supervisor (systemd, a
shell loop) that restarts it. A restarted worker announces itself with a new Ready. While the
gateway waits for a worker it sends HELLO with a session id, and a worker answers a session
new to it with its Ready (aborting the requests of the session before, which has no one to
give them to). Every wait has a new session: a restarted gateway takes back a worker that is
still running, and so does a gateway that gave up on a worker fallen silent (a pause, a
network partition) once it speaks again.
"""

from __future__ import annotations

import os
import time
from urllib.parse import urlsplit

import logging

import msgspec
import zmq

from spillway.gateway.link.worker_process import WorkerStartError, check_handshake
from spillway.protocol.config import WorkerConfig
from spillway.protocol.local.drop_log import DropLog
from spillway.protocol.local.link_auth import LinkKeys, require_key_off_loopback
from spillway.protocol.messages import Control, ControlCommand, Ready, WorkerError, encoder, worker_decoder


def worker_addresses(address: str) -> tuple[str, str]:
    """tcp://HOST:PORT -> (gateway-to-worker address, worker-to-gateway address)."""
    parts = urlsplit(address)
    if parts.scheme != "tcp" or not parts.hostname or parts.port is None:
        raise ValueError(f"a worker address looks like tcp://HOST:PORT, not {address!r}")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    if parts.port >= 65535:
        raise ValueError(f"port {parts.port} leaves no room for the second port")
    return f"tcp://{host}:{parts.port}", f"tcp://{host}:{parts.port + 1}"


class RemoteWorker:
    """The gateway's end of a remote worker's two sockets. Bound once, kept across restarts."""

    def __init__(self, address: str, config: WorkerConfig, ctx: zmq.Context | None = None,
                 keys: LinkKeys | None = None, link: tuple[str, str] | None = None) -> None:
        """`link`: (inbox, outbox) to bind instead of the two ports of `address` (an API server's
        ipc link to the worker its first server started; `address` then only names it)."""
        self.config = config
        self.address = address
        if link is None:
            inbox, outbox = worker_addresses(address)
            require_key_off_loopback(address, keys)
        else:
            inbox, outbox = link
        ctx = ctx or zmq.Context.instance()
        self.to_worker = ctx.socket(zmq.PUSH)
        self.from_worker = ctx.socket(zmq.PULL)
        for sock, bound in ((self.to_worker, inbox), (self.from_worker, outbox)):
            sock.setsockopt(zmq.LINGER, 0)
            if keys is not None:
                keys.secure_gateway_socket(sock)
            try:
                sock.bind(bound)
            except zmq.ZMQError:
                self.shutdown()
                raise
        self._decoder = worker_decoder()
        self._encoder = encoder()
        self._kept: Ready | None = None
        self._drops = DropLog(logging.getLogger("spillway.gateway"), "from the worker")
        self._new_session()

    def _new_session(self) -> None:
        self._hello = self._encoder.encode(Control(ControlCommand.HELLO, session=os.urandom(8)))

    def __call__(self) -> RemoteWorker:
        """As the client's `start_worker`: the same sockets serve the next worker."""
        return self

    @property
    def alive(self) -> bool:
        return True  # the client's heartbeat decides

    def keep_ready(self, ready: Ready) -> None:
        """A Ready that arrived while serving: the next wait_ready returns it."""
        self._kept = ready

    def wait_ready(self, timeout_s: float = float("inf"), on_wait=None) -> Ready:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._kept is not None:
                ready, self._kept = self._kept, None
                check_handshake(ready, self.config)
                return ready
            self._say_hello()
            if not self.from_worker.poll(500):
                if on_wait is not None:
                    on_wait()
                continue
            data = self.from_worker.recv()
            try:
                msg = self._decoder.decode(data)
            except msgspec.DecodeError as exc:
                self._drops.drop(f"{len(data)} bytes that do not decode: {exc}")
                continue
            match msg:
                case Ready() as ready:
                    self._kept = ready
                case WorkerError(message=message):
                    raise WorkerStartError(f"the remote worker failed: {message}")
                case _:
                    pass  # output of a previous worker's session
        raise WorkerStartError(f"no worker connected to {self.address} within {timeout_s:.0f} s")

    def _say_hello(self) -> None:
        """HELLO to a worker that may be running already; with none connected, nothing is sent.
        A worker answers a repeated HELLO of the same session once."""
        try:
            self.to_worker.send(self._hello, zmq.NOBLOCK)
        except zmq.Again:
            pass

    def send(self, msg) -> None:
        self.to_worker.send(self._encoder.encode(msg))

    def close(self) -> None:
        """End one worker's session; the sockets stay bound for the next one, which is asked
        for with a new session: a worker that comes back answers it, even the same one."""
        self._new_session()

    def shutdown(self) -> None:
        self.to_worker.close()
        self.from_worker.close()
