"""What a Ray actor runs for one replica (`--distributed-executor-backend ray`): it keeps that
replica's worker program running on the node its placement group reserved, restarting it
whenever it exits, until the gateway stops it.

    actor (this class) ── stdin: WorkerLaunch (msgpack) ──▶ python -m spillway.worker
                                                              │ tcp:// link, CURVE-keyed
                                                              ▼
                                                            the gateway's RemoteWorker

The worker is the program a local gateway starts (gateway/link/worker_process.py), with the
replica's WorkerConfig as the gateway built it, verbatim: a command line would carry only what
`spillway worker` has flags for. The actor is its parent and holds its launch pipe, so the
worker ends with the actor however the actor ends (killed at the gateway's close, or with its
node). The link's secret reaches the worker as SPILLWAY_WORKER_KEY in its environment, never on a
command line. Plain Python: Ray wraps it (`ray.remote(WorkerHost)`) where it is placed, and only
strings, bytes and numbers cross Ray (the config as msgpack bytes).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

import msgspec

from spillway.gateway.link.worker_link import FIRST_RESTART_DELAY_S, MAX_RESTART_DELAY_S
from spillway.gateway.link.worker_process import WORKER_COMMAND, ChildProcess, describe_exit
from spillway.protocol.config import WorkerConfig, WorkerLaunch

logger = logging.getLogger("spillway.gateway")

# The link's backoff (a worker that lived MAX_RESTART_DELAY_S was not failing to start: it resets).


class WorkerHost:
    """Runs the worker program over and over; each run is a generation (1, 2, ...)."""

    def __init__(self, config: bytes, inbox: str, outbox: str, worker_key: str, env: dict[str, str],
                 command: list[str] | None = None) -> None:
        self._launch = WorkerLaunch(config=msgspec.msgpack.decode(config, type=WorkerConfig), inbox=inbox,
                                    outbox=outbox, parent_pid=os.getpid())
        self._env = {**env, "SPILLWAY_WORKER_KEY": worker_key}
        self._command = list(command or WORKER_COMMAND)
        self._changed = threading.Condition()
        self._child: ChildProcess | None = None
        self._generation = 0
        self._exit_codes: dict[int, int | None] = {}  # generation -> how it ended
        self._stopping = False
        threading.Thread(target=self._supervise, name="spillway-worker-host", daemon=True).start()

    def worker(self) -> tuple[int, int, str]:
        """(generation, pid, host name) of the running worker; waits while one is being restarted."""
        with self._changed:
            self._changed.wait_for(lambda: self._stopping or self._running())
            if not self._running():
                raise RuntimeError("the worker host is stopping")
            return self._generation, self._child.pid, socket.gethostname()

    def _running(self) -> bool:
        return self._child is not None and self._generation not in self._exit_codes

    def wait_exit(self, generation: int) -> int | None:
        """How that generation's worker ended, once it has (subprocess's returncode)."""
        with self._changed:
            self._changed.wait_for(lambda: generation in self._exit_codes)
            return self._exit_codes[generation]

    def kill_worker(self, generation: int) -> None:
        """SIGKILL that generation's worker, if it still runs (one that stopped answering)."""
        with self._changed:
            if generation == self._generation and self._child is not None:
                self._child.kill()

    def stop(self) -> None:
        """End the worker (its launch pipe closed: it exits at once, even mid-load) and restart no more."""
        with self._changed:
            self._stopping = True
            child = self._child
            self._changed.notify_all()
        if child is not None:
            child.release()

    def _supervise(self) -> None:
        quick_exits = 0
        while True:
            with self._changed:
                if self._stopping:
                    return
                self._generation += 1
                self._child = child = ChildProcess(self._command, self._launch, self._env)
                generation = self._generation
                self._changed.notify_all()
            started = time.monotonic()
            child.join()
            with self._changed:
                self._exit_codes[generation] = child.exitcode
                self._changed.notify_all()
            quick_exits = quick_exits + 1 if time.monotonic() - started < MAX_RESTART_DELAY_S else 0
            delay = restart_delay(quick_exits)
            if not self._stopping:
                logger.warning("the worker (pid %d) %s; starting another in %.0f s", child.pid,
                               describe_exit(child.exitcode), delay)
            child.release()
            with self._changed:
                self._changed.wait_for(lambda: self._stopping, delay)


def restart_delay(quick_exits: int) -> float:
    """Seconds before the next start, after `quick_exits` workers in a row lived less than
    MAX_RESTART_DELAY_S: 1 s after a worker that ran, then doubling while they keep failing."""
    return min(FIRST_RESTART_DELAY_S * 2 ** max(quick_exits - 1, 0), MAX_RESTART_DELAY_S)
