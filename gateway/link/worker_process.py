"""Start a local worker process and talk to it over two ZeroMQ sockets (the gateway binds both).

The worker is its own program, `python -m spillway.worker`, started with subprocess: never
through multiprocessing, whose spawn re-imports the user's main module, so that a plain script
(`llm = LLM()` at top level, no `__main__` guard) works. Its configuration travels on its stdin
as msgpack (protocol/config.py); the pipe stays open while this process lives, and the worker
exits at its EOF, so a worker never outlives its gateway, however the gateway ends.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import weakref

import zmq

from spillway.protocol.config import WorkerConfig, WorkerLaunch, encode_launch
from spillway.protocol.messages import (
    PROTOCOL_VERSION,
    Control,
    ControlCommand,
    Ready,
    StepOutputs,
    WorkerError,
    WorkerMessage,
    encoder,
    worker_decoder,
)

WORKER_COMMAND = (sys.executable, "-m", "spillway.worker")
# How long a worker told to stop (SHUTDOWN, or its launch pipe closed) may take to exit before it
# is killed: it closes its sockets and leaves with os._exit, well under a second.
EXIT_WAIT_S = 5.0


class WorkerStartError(RuntimeError):
    pass


def describe_exit(code: int | None) -> str:
    """How a process ended, from subprocess's returncode: "exited with code 1", "was killed by
    SIGKILL" (a negative code is the signal that ended it)."""
    if code is None:
        return "ended (its exit status is not known yet)"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def check_handshake(ready: Ready, config: WorkerConfig) -> None:
    """Refuse a worker that would hash or page differently from this gateway."""
    if ready.protocol_version != PROTOCOL_VERSION:
        raise WorkerStartError(f"worker speaks protocol {ready.protocol_version}, gateway {PROTOCOL_VERSION}")
    if ready.block_size != config.block_size:
        raise WorkerStartError(f"worker block size {ready.block_size} != gateway's {config.block_size}")
    if ready.hash_seed != config.hash_seed:
        raise WorkerStartError("worker hash seed differs from the gateway's")


class ChildProcess:
    """A started worker program, seen as multiprocessing shows a process: `pid`, `exitcode`,
    `is_alive()`, `join()`, `terminate()`, and `sentinel`, an FD readable once it has exited."""

    def __init__(self, command: list[str], launch: WorkerLaunch, env: dict[str, str] | None = None) -> None:
        # The child holds the write end of this pipe and never writes: the read end turns
        # readable (EOF) when the child has exited, as multiprocessing's sentinel does.
        self.sentinel, child_end = os.pipe()
        try:
            # A session of its own: a terminal's Ctrl-C, sent to the gateway's process group,
            # never reaches the worker (not even while it imports); its gateway stops it.
            self._popen = subprocess.Popen(command, stdin=subprocess.PIPE, pass_fds=(child_end,),
                                           start_new_session=True, env={**os.environ, **env} if env else None)
        finally:
            os.close(child_end)
        self.pid = self._popen.pid
        try:
            self._popen.stdin.write(encode_launch(launch))
            self._popen.stdin.flush()
        except BrokenPipeError:
            pass  # it died at once: wait_ready reports its exit code
        # Closing stdin (or exiting) tells the worker its gateway is gone. Not run at exit: the
        # owner's own close (an `LLM`'s finalizer, made earlier, so run later) stops the worker
        # in order first; without one, the pipe closing with this process ends the worker.
        self._finalizer = weakref.finalize(self, _stop, self._popen, self.sentinel)
        self._finalizer.atexit = False

    @property
    def exitcode(self) -> int | None:
        return self._popen.poll()

    def is_alive(self) -> bool:
        return self._popen.poll() is None

    def join(self, timeout: float | None = None) -> None:
        try:
            self._popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def terminate(self) -> None:
        if self.is_alive():
            self._popen.terminate()

    def kill(self) -> None:
        if self.is_alive():
            self._popen.kill()

    def release(self) -> None:
        """Close the pipes; a worker still running sees EOF and exits."""
        self._finalizer()


def _stop(popen: subprocess.Popen, sentinel: int) -> None:
    try:
        popen.stdin.close()
    except OSError:  # the worker is gone, its pipe broken
        pass
    try:
        popen.wait(EXIT_WAIT_S)
    except subprocess.TimeoutExpired:
        popen.kill()
        popen.wait()
    os.close(sentinel)


class WorkerProcess:
    """A local worker process and its sockets."""

    def __init__(self, config: WorkerConfig, ctx: zmq.Context | None = None,
                 command: list[str] | tuple[str, ...] = WORKER_COMMAND,
                 extra_links: list[tuple[str, str]] | None = None, env: dict[str, str] | None = None) -> None:
        """`extra_links`: (inbox, outbox) of the other API servers on this one's port, which the
        worker serves too (gateway/http/api_servers.py); `env`: variables set for the worker
        over this process's (a data-parallel replica's GPUs or threads)."""
        self.config = config
        self.ready: Ready | None = None
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
        launch = WorkerLaunch(config=config, inbox=inbox, outbox=outbox, parent_pid=os.getpid(),
                              extra_links=list(extra_links or []))
        self._child = ChildProcess(list(command), launch, env)
        self.process = self._child

    def wait_ready(self, timeout_s: float = 600.0, on_wait=None) -> Ready:
        """Block until the worker says Ready (at once if it has); raise with the worker's reason
        if it cannot start."""
        if self.ready is not None:
            return self.ready
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            msg = self.recv(timeout_ms=500)
            match msg:
                case Ready():
                    check_handshake(msg, self.config)
                    self.ready = msg
                    return msg
                case WorkerError(message=message):
                    self.close()
                    raise WorkerStartError(message)
                case StepOutputs(iteration_s=float()):
                    pass  # a heartbeat, on a connection of its own, may overtake the Ready
                case None:
                    if not self.process.is_alive():
                        raise WorkerStartError(f"the worker process {describe_exit(self.process.exitcode)}")
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

    def kill(self) -> None:
        """SIGKILL: a worker that stopped answering (stopped, frozen) would not heed SHUTDOWN,
        and a stopped one not even SIGTERM. Not waited for here (the caller may be the event
        loop): `close`, in a thread, reaps it."""
        self.process.kill()

    def close(self) -> None:
        if self.ready is None:
            self._child.release()  # still loading, deaf to SHUTDOWN: the pipe's EOF ends it at once
        if self.process.is_alive():
            try:
                # Not blocking: a worker that is exiting (after a start-up error) has left no
                # peer, and a PUSH send with no peer would wait forever.
                self.to_worker.send(self._encoder.encode(Control(ControlCommand.SHUTDOWN)), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            self.process.join(EXIT_WAIT_S)
            if self.process.is_alive():
                self.process.terminate()
                self.process.join(EXIT_WAIT_S)
        self._child.release()
        self.to_worker.close()
        self.from_worker.close()
        shutil.rmtree(self._dir, ignore_errors=True)
