"""The gateway's link to one worker at a time: start it, read from it, send to it, notice its
death, start its replacement.

    start_worker() -> handle (WorkerProcess, RemoteWorker, a test's fake)
        handle.wait_ready()        in a thread: a worker loads for seconds to minutes
        attach: reader task on the socket FD, exit FD of the process
        ... on_message(StepOutputs) for every step ...
        death: process exit FD, fatal WorkerError, a socket error, silence or a step past
        its bound (gateway/link/worker_liveness.py)
        -> on_lost(reason), then start_worker() again, with back-off, until one is ready
        (a local worker that hangs is killed first; a remote worker that was only silent is
        taken back by a new HELLO session)

A message that does not decode, or that the link does not expect, is logged (rate-limited) and
dropped: whoever can push bytes at the gateway's port must not be able to end the link.

The handle's sockets are synchronous pyzmq sockets used only from the event loop thread once
attached; the loop watches their FD (ZeroMQ signals it edge-style, so the reader drains until
ZMQ_EVENTS shows no more input before it waits again).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections import deque
from collections.abc import Callable

import msgspec
import zmq

from spillway.gateway.link.worker_liveness import Liveness
from spillway.gateway.link.worker_process import describe_exit
from spillway.protocol.local.drop_log import DropLog
from spillway.protocol.messages import Control, ControlCommand, Ready, StepOutputs, WorkerError, encoder, worker_decoder

logger = logging.getLogger("spillway.gateway")

PROGRESS_INTERVAL_S = 5.0  # between "waiting for ..." log lines
WATCH_INTERVAL_S = 0.5
# A replacement that fails to start is tried again after FIRST_RESTART_DELAY_S, doubling up to
# MAX_RESTART_DELAY_S: a failing worker is not restarted in a tight loop.
FIRST_RESTART_DELAY_S = 1.0
MAX_RESTART_DELAY_S = 30.0


class LinkState(enum.IntEnum):
    STARTING = 0
    READY = 1
    RESTARTING = 2
    CLOSED = 3


class _StopWaiting(Exception):
    pass


def _exit_reason(handle) -> str:
    return f"the worker process {describe_exit(handle.process.exitcode)}"


class WorkerLink:
    """Keeps one worker attached; reports its steps and its death through two callbacks."""

    def __init__(self, start_worker: Callable[[], object], *, on_step: Callable[[StepOutputs], None],
                 on_lost: Callable[[str], None], ready_timeout_s: float = 600.0,
                 heartbeat_timeout_s: float | None = None, step_timeout_s: float | None = None,
                 replace_lost_worker: bool = True, log_prefix: str = "") -> None:
        """`log_prefix` leads this link's log lines (a replica's: "replica 1: ")."""
        self._start_worker = start_worker
        self._log_prefix = log_prefix
        self._replace_lost_worker = replace_lost_worker  # False: a lost worker closes the link
        self._on_step = on_step
        self._on_lost = on_lost
        self._ready_timeout_s = ready_timeout_s
        self._liveness = Liveness(heartbeat_timeout_s, step_timeout_s)
        self.state = LinkState.STARTING
        self.ready: Ready | None = None
        self.num_restarts = 0
        self.lost_reason: str | None = None
        self._handle = None
        self._reader: asyncio.Task | None = None
        self._flusher: asyncio.Task | None = None
        self._watcher: asyncio.Task | None = None
        self._restarter: asyncio.Task | None = None
        self._reaper: asyncio.Task | None = None  # waits for an exited worker's status
        self._fds: list[int] = []
        self._backlog: deque[bytes] = deque()
        self._closed = asyncio.Event()
        self._encoder = encoder()
        self.drops = DropLog(logger, "from the worker")

    async def start(self) -> Ready:
        handle, ready = await self._launch()
        self._attach(handle, ready)
        self._watcher = asyncio.create_task(self._watch(), name="spillway-worker-watch")
        return ready

    async def close(self) -> None:
        self.state = LinkState.CLOSED
        self._closed.set()
        if self._watcher is not None:
            self._watcher.cancel()
        if self._restarter is not None:
            await asyncio.gather(self._restarter, return_exceptions=True)
        handle = self._detach()
        if handle is not None:
            try:
                await asyncio.to_thread(handle.close)
            except RuntimeError:  # at interpreter exit (an `LLM` closed by its finalizer) no thread is lent
                handle.close()

    @property
    def silent_s(self) -> float:
        """Seconds since the attached worker last said anything (0 before one is attached)."""
        last = self._liveness.last_heard
        return time.monotonic() - last if last else 0.0

    @property
    def worker_pid(self) -> int | None:
        process = getattr(self._handle, "process", None)
        return process.pid if process is not None else None

    def send(self, msg) -> None:
        """Queue a message for the worker, in order; dropped if no worker is attached."""
        if self.state is not LinkState.READY:
            return
        data = self._encoder.encode(msg)
        if self._backlog:
            self._backlog.append(data)
            return
        try:
            self._handle.to_worker.send(data, zmq.NOBLOCK)
        except zmq.Again:  # the worker's inbox is full: keep the order, send as it drains
            self._backlog.append(data)
            self._flusher = asyncio.create_task(self._flush_backlog(self._handle))

    async def _flush_backlog(self, handle) -> None:
        while self._backlog:
            try:
                handle.to_worker.send(self._backlog[0], zmq.NOBLOCK)
            except zmq.Again:
                await asyncio.sleep(0.005)
                continue
            self._backlog.popleft()

    # ---- reading ----------------------------------------------------------------------------

    async def _read(self, handle, readable: asyncio.Event) -> None:
        sock, decoder = handle.from_worker, worker_decoder()
        try:
            while True:
                readable.clear()
                count = 0
                while sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                    data = sock.recv(zmq.NOBLOCK)
                    try:
                        msg = decoder.decode(data)
                    except msgspec.DecodeError as exc:
                        self.drops.drop(f"{len(data)} bytes that do not decode: {exc}")
                        continue
                    if not self._dispatch(handle, msg):
                        return
                    count += 1
                    if count % 64 == 0:
                        await asyncio.sleep(0)  # let the handlers run during a burst
                await readable.wait()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a broken socket: this worker is unusable
            logger.exception("reading from the worker failed")
            self._lose(handle, f"lost the connection to the worker: {exc}")

    def _dispatch(self, handle, msg) -> bool:
        """Handle one message; False once this worker is finished."""
        match msg:
            case StepOutputs(iteration_s=float() as iteration_s):  # a heartbeat
                if (reason := self._liveness.step_overrun(iteration_s)) is not None:
                    self._lose(handle, reason, hung=True)
                    return False
            case StepOutputs():
                self._on_step(msg)
            case WorkerError(fatal=True):
                self._lose(handle, f"the worker failed: {msg.message}")
                return False
            case WorkerError():
                logger.warning("%sworker error: %s", self._log_prefix, msg.message)
            case Ready() if msg.worker_session and msg.worker_session == self.ready.worker_session:
                pass  # the attached worker answering a HELLO sent while this link waited for it
            case Ready():
                if hasattr(handle, "keep_ready"):  # a remote worker restarted under us
                    handle.keep_ready(msg)
                self._lose(handle, "the worker restarted on its own")
                return False
            case _:
                self.drops.drop(f"an unexpected {type(msg).__name__}")
                return True
        self._liveness.heard(time.monotonic())  # only a worker's own answers prove it alive
        return True

    # ---- attaching, losing, replacing -------------------------------------------------------

    def _attach(self, handle, ready: Ready) -> None:
        loop = asyncio.get_running_loop()
        self._handle, self.ready = handle, ready
        self._liveness.heard(time.monotonic())
        readable = asyncio.Event()
        socket_fd = handle.from_worker.getsockopt(zmq.FD)
        loop.add_reader(socket_fd, readable.set)
        self._fds = [socket_fd]
        process = getattr(handle, "process", None)
        if process is not None:  # readable the moment the process exits
            loop.add_reader(process.sentinel, self._on_exit, handle)
            self._fds.append(process.sentinel)
        self._reader = asyncio.create_task(self._read(handle, readable), name="spillway-worker-reader")
        self.state = LinkState.READY

    def _detach(self):
        handle, self._handle = self._handle, None
        # Unregister the FDs now: the sockets are closed in another thread, and a closed FD's
        # number, soon reused by the next worker's socket, must not stay registered.
        loop = asyncio.get_running_loop()
        for fd in self._fds:
            loop.remove_reader(fd)
        self._fds = []
        for task in (self._reader, self._flusher):
            if task is not None and task is not asyncio.current_task():
                task.cancel()
        self._reader = self._flusher = None
        self._backlog.clear()
        return handle

    def _on_exit(self, handle) -> None:
        process = handle.process
        if process.exitcode is None:
            # The exit FD turns readable as the process closes its files, a moment before the
            # kernel reports its status: poll for that (no thread: this may run at interpreter
            # exit, when the default executor takes no more work).
            asyncio.get_running_loop().remove_reader(process.sentinel)
            self._reaper = asyncio.create_task(self._on_exit_reaped(handle), name="spillway-worker-reap")
            return
        self._lose(handle, _exit_reason(handle))

    async def _on_exit_reaped(self, handle) -> None:
        for _ in range(200):  # 2 s
            if handle.process.exitcode is not None:
                break
            await asyncio.sleep(0.01)
        self._lose(handle, _exit_reason(handle))

    def _lose(self, handle, reason: str, hung: bool = False) -> None:
        """`hung`: the worker may be alive but deaf (stopped, frozen, stuck in a step): a local
        one, our child, is killed now, before its requests fail, since it would not stop when asked."""
        if handle is not self._handle or self.state is not LinkState.READY:
            return
        self.lost_reason = reason
        if hung and hasattr(handle, "kill"):
            handle.kill()
        if not self._replace_lost_worker:
            logger.error("%s%s; in-flight requests fail", self._log_prefix, reason)
            self.state = LinkState.CLOSED
            old = self._detach()
            self._on_lost(reason)
            self._restarter = asyncio.create_task(asyncio.to_thread(old.close), name="spillway-worker-close")
            return
        logger.error("%s%s; in-flight requests fail and a new worker is starting", self._log_prefix, reason)
        self.state = LinkState.RESTARTING
        old = self._detach()
        self._on_lost(reason)
        self._restarter = asyncio.create_task(self._restart(old), name="spillway-worker-restart")

    async def _restart(self, old) -> None:
        await asyncio.to_thread(old.close)
        delay = FIRST_RESTART_DELAY_S
        while self.state is LinkState.RESTARTING:
            try:
                handle, ready = await self._launch()
            except _StopWaiting:
                return
            except Exception as exc:
                logger.error("%sthe new worker did not start: %s; retrying in %.0f s", self._log_prefix, exc, delay)
                try:
                    await asyncio.wait_for(self._closed.wait(), delay)
                except asyncio.TimeoutError:
                    pass
                delay = min(2 * delay, MAX_RESTART_DELAY_S)
                continue
            self.num_restarts += 1
            self._attach(handle, ready)

    async def _launch(self):
        handle = await asyncio.to_thread(self._start_worker)
        started = time.monotonic()
        last_report = started

        def on_wait() -> None:  # runs in wait_ready's thread, twice a second
            nonlocal last_report
            if self.state is LinkState.CLOSED:
                raise _StopWaiting()
            now = time.monotonic()
            if now - last_report >= PROGRESS_INTERVAL_S:
                last_report = now
                logger.info("%swaiting for the worker to load the model (%.0f s)", self._log_prefix, now - started)

        try:
            ready = await asyncio.to_thread(handle.wait_ready, self._ready_timeout_s, on_wait)
        except BaseException:
            await asyncio.to_thread(handle.close)
            raise
        logger.info("%sworker ready: %s on %s (%s), %d KV blocks of %d tokens, max_model_len %d, in %.1f s",
                    self._log_prefix, ready.model, ready.device, ready.dtype, ready.num_gpu_blocks, ready.block_size,
                    ready.max_model_len, time.monotonic() - started)
        return handle, ready

    async def _watch(self) -> None:
        """Backstop for deaths no FD shows: a process gone unnoticed, a worker gone silent."""
        while self.state is not LinkState.CLOSED:
            await asyncio.sleep(WATCH_INTERVAL_S)
            handle = self._handle
            if self.state is not LinkState.READY or handle is None:
                continue
            if not handle.alive:
                self._lose(handle, _exit_reason(handle) if getattr(handle, "process", None) else "the worker is gone")
            elif (reason := self._liveness.silence(time.monotonic())) is not None:
                self._lose(handle, reason, hung=True)
            elif self._liveness.should_probe(time.monotonic()):
                self.send(Control(ControlCommand.STATS))  # any answer proves it alive
