"""One replica's worker on a Ray cluster, as the worker link takes a handle (gateway/link/worker_link.py).

    ActorWorker         the replica's RemoteWorker (two ports bound once, CURVE-keyed) and
                        the worker process its actor started (gateway/replicas/worker_host.py)
    ActorWorkerProcess  that process as the link sees a local one: pid, exitcode, and a
                        `sentinel` FD readable once it has exited (the actor says so)

So a worker killed on another node is lost at once, as a local one is (its streams end, a
request nothing of which had come back goes to another replica), where a plain remote worker is
lost only when its heartbeats stop; its actor starts another, which attaches as a remote worker
does, with a new HELLO session.
"""

from __future__ import annotations

import logging
import os
import threading

from spillway.gateway.link.client import DEFAULT_HEARTBEAT_TIMEOUT_S
from spillway.gateway.link.remote_worker import RemoteWorker
from spillway.protocol.messages import Ready

logger = logging.getLogger("spillway.gateway")

# An actor that does not answer within the link's bound on a silent worker is as lost as one.
ACTOR_ANSWER_S = DEFAULT_HEARTBEAT_TIMEOUT_S


class ActorWorkerProcess:
    """A worker process on a Ray node, seen as multiprocessing shows a process."""

    def __init__(self, host, generation: int, pid: int) -> None:
        self.pid = pid
        self.exitcode: int | None = None
        self._host, self._generation = host, generation
        self._exited = False
        self.sentinel, self._write_end = os.pipe()
        self._lock = threading.Lock()
        host.wait_exit.remote(generation).future().add_done_callback(self._on_exit)

    def _on_exit(self, answer) -> None:
        """In a thread of Ray's: the worker ended, or its actor did (its status then unknown)."""
        try:
            self.exitcode = answer.result()
        except Exception as exc:
            if self.sentinel >= 0:  # not at the gateway's close, which kills the actors
                logger.warning("the Ray actor of the worker (pid %d) is gone: %s", self.pid, exc)
        with self._lock:
            self._exited = True
            if self._write_end >= 0:
                os.close(self._write_end)  # the sentinel turns readable (EOF)
                self._write_end = -1

    def is_alive(self) -> bool:
        return not self._exited

    def kill(self) -> None:
        self._host.kill_worker.remote(self._generation)

    def release(self) -> None:
        with self._lock:
            for fd in (self.sentinel, self._write_end):
                if fd >= 0:
                    os.close(fd)
            self.sentinel = self._write_end = -1


class ActorWorker:
    """A replica's worker on Ray; `ActorWorker(remote, host, replica)` is the replica's `start_worker`:
    the actor has a worker running (or starting) already, so starting one is waiting for it."""

    def __init__(self, remote: RemoteWorker, host, replica: int) -> None:
        self._remote, self._host, self._replica = remote, host, replica
        self.to_worker, self.from_worker = remote.to_worker, remote.from_worker
        self.process: ActorWorkerProcess | None = None

    def wait_ready(self, timeout_s: float = float("inf"), on_wait=None) -> Ready:
        ready = self._remote.wait_ready(timeout_s, on_wait)
        # The worker that answered is the actor's current one; if it died meanwhile, the next
        # one's Ready tells the link it restarted.
        generation, pid, node = self._host.worker.remote().future().result(ACTOR_ANSWER_S)
        self.process = ActorWorkerProcess(self._host, generation, pid)
        logger.info("replica %d: worker pid %d on %s", self._replica, pid, node)
        return ready

    @property
    def alive(self) -> bool:
        return self.process is None or self.process.is_alive()

    def keep_ready(self, ready: Ready) -> None:
        self._remote.keep_ready(ready)

    def kill(self) -> None:
        if self.process is not None:
            self.process.kill()

    def close(self) -> None:
        """End this worker's session; the replica's sockets and actor stay for the next one."""
        self._remote.close()
        if self.process is not None:
            self.process.release()
