"""Start a worker process and talk to it over two ZeroMQ sockets (the gateway binds both)."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import tempfile
import time

import msgspec
import zmq

from spillway.protocol.messages import (
    PROTOCOL_VERSION,
    Control,
    ControlCommand,
    Ready,
    WorkerError,
    WorkerMessage,
    encoder,
    worker_decoder,
)
from spillway.worker.config import WorkerConfig


class WorkerStartError(RuntimeError):
    pass


def check_handshake(ready: Ready, config: WorkerConfig) -> None:
    """Refuse a worker that would hash or page differently from this gateway."""
    if ready.protocol_version != PROTOCOL_VERSION:
        raise WorkerStartError(f"worker speaks protocol {ready.protocol_version}, gateway {PROTOCOL_VERSION}")
    if ready.block_size != config.block_size:
        raise WorkerStartError(f"worker block size {ready.block_size} != gateway's {config.block_size}")
    if ready.hash_seed != config.hash_seed:
        raise WorkerStartError("worker hash seed differs from the gateway's")


class WorkerProcess:
    """A local worker process started with multiprocessing's spawn, and its sockets."""

    def __init__(self, config: WorkerConfig, ctx: zmq.Context | None = None) -> None:
        self.config = config
        self._ctx = ctx or zmq.Context.instance()
        self._dir = tempfile.mkdtemp(prefix="spillway-")  # 0700: only this user reaches the sockets
        inbox, outbox = f"ipc://{self._dir}/in", f"ipc://{self._dir}/out"
        self.to_worker = self._ctx.socket(zmq.PUSH)
        self.to_worker.setsockopt(zmq.LINGER, 0)
        self.to_worker.bind(inbox)
        self.from_worker = self._ctx.socket(zmq.PULL)
        self.from_worker.setsockopt(zmq.LINGER, 0)
        self.from_worker.bind(outbox)
        self._encoder = encoder()
        self._decoder = worker_decoder()
        from spillway.worker.main import spawn_entry

        self.process = multiprocessing.get_context("spawn").Process(
            target=spawn_entry,
            args=(msgspec.msgpack.encode(config), inbox, outbox, os.getpid()),
            name="spillway-worker",
            daemon=True,
        )
        self.process.start()

    def wait_ready(self, timeout_s: float = 600.0, on_wait=None) -> Ready:
        """Block until the worker says Ready; raise with the worker's reason if it cannot start."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            msg = self.recv(timeout_ms=500)
            match msg:
                case Ready():
                    check_handshake(msg, self.config)
                    return msg
                case WorkerError(message=message):
                    self.close()
                    raise WorkerStartError(message)
                case None:
                    if not self.process.is_alive():
                        raise WorkerStartError(f"the worker process exited with code {self.process.exitcode}")
                    if on_wait is not None:
                        on_wait()
                case _:
                    raise WorkerStartError(f"unexpected {type(msg).__name__} before Ready")
        self.close()
        raise WorkerStartError(f"the worker did not become ready within {timeout_s:.0f} s")

    def send(self, msg) -> None:
        self.to_worker.send(self._encoder.encode(msg))

    def recv(self, timeout_ms: int | None = None) -> WorkerMessage | None:
        if timeout_ms is not None and not self.from_worker.poll(timeout_ms):
            return None
        return self._decoder.decode(self.from_worker.recv())

    @property
    def alive(self) -> bool:
        return self.process.is_alive()

    def close(self) -> None:
        if self.process.is_alive():
            try:
                # Not blocking: a worker that is exiting (after a start-up error) has left no
                # peer, and a PUSH send with no peer would wait forever.
                self.to_worker.send(self._encoder.encode(Control(ControlCommand.SHUTDOWN)), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            self.process.join(5)
            if self.process.is_alive():
                self.process.terminate()
                self.process.join(5)
        self.to_worker.close()
        self.from_worker.close()
        shutil.rmtree(self._dir, ignore_errors=True)
