"""Several API servers on one port (`spillway serve --api-server-count N`), as vLLM runs them.

One event loop takes a request in at a time: a burst of long prompts (a 10k-id body costs
~1-1.5 ms to read, check, hash and send) reaches the worker over tens of milliseconds. N
processes share the listening socket, each taking one connection per turn of its event loop
(gateway/http/shared_accept.py, so a burst spreads over them), and each has a link of its own to
the one worker:

    spillway serve (API server 0) ── binds the port, starts the worker with links 1..N-1
      ├─ API server 1..N-1: forked before the worker starts, same settings, same socket;
      │    each binds its ipc link and waits for the worker (a HELLO session, as a remote
      │    gateway does: gateway/link/remote_worker.py)
      └─ worker: serves every link (worker/gateway_links.py)

One socket, as vLLM's servers share theirs, not one per server (SO_REUSEPORT): the kernel
would spread a burst evenly, but a server that stalls would hold the connections hashed to it,
and on the H200's 50-request convoy a socket each did no better (TTFT p50 84.8 ms with 4
servers, against 53.9 and 92.5 in two runs on one socket: the worker, ~1 ms of its time per
10k-token prompt, is what a fast burst waits on; docs/performance.md).

Metrics are summed across the processes (gateway/metrics/metrics.py); only server 0 turns the worker's
Stats into metrics and logs the stats line. Any server that exits on its own stops them all,
as vLLM does; each exits at once if server 0's process is gone.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import wait

from spillway.gateway.metrics.metrics import share_metrics_across_processes
from spillway.gateway.http.shared_accept import OpenConnections
from spillway.gateway.link.worker_process import describe_exit

logger = logging.getLogger("spillway.gateway")

STOP_GRACE_S = 8.0  # uvicorn's graceful shutdown (5 s) and a little


class ApiServers:
    """API servers 1..count-1 of this process's port; this process is server 0."""

    def __init__(self, count: int) -> None:
        if count < 1:
            raise ValueError(f"--api-server-count must be at least 1, got {count}")
        self.count = count
        self._folder = tempfile.mkdtemp(prefix="spillway-api-")  # 0700: only this user reaches the links
        os.mkdir(os.path.join(self._folder, "metrics"))
        share_metrics_across_processes(os.path.join(self._folder, "metrics"))
        self.links = [(f"ipc://{self._folder}/in{k}", f"ipc://{self._folder}/out{k}") for k in range(1, count)]
        self._processes: list[multiprocessing.process.BaseProcess] = []
        self._stopping = False
        self.serving = False  # server 0 serves: the others' streams are worth a graceful stop
        self.failed: str | None = None  # why a server that exited on its own stopped them all
        self._alive_read, self._alive_write = os.pipe()  # EOF in a server: server 0 is gone
        self._serving = multiprocessing.get_context("fork").Event()  # set once server 0 serves
        self.connections = OpenConnections(count)  # each server's open connections, for the others to see

    def start(self, serve: Callable[[int, tuple[str, str]], int]) -> None:
        """Fork servers 1..count-1, each running `serve(index, link)` (it returns an exit status).
        Call before this process makes threads or ZeroMQ sockets, which a fork does not carry."""
        context = multiprocessing.get_context("fork")
        for index, link in enumerate(self.links, 1):
            process = context.Process(target=self._run_server, args=(serve, index, link),
                                      name=f"spillway-api-server-{index}", daemon=False)
            process.start()
            self._processes.append(process)
        os.close(self._alive_read)
        self._alive_read = -1
        if self._processes:
            threading.Thread(target=self._watch, name="spillway-api-servers-watch", daemon=True).start()

    def _run_server(self, serve: Callable[[int, tuple[str, str]], int], index: int, link: tuple[str, str]) -> None:
        os.setpgid(0, 0)  # a terminal's Ctrl-C reaches server 0 alone, which stops the others in order
        os.close(self._alive_write)
        alive = self._alive_read

        def watch_server_0() -> None:
            while os.read(alive, 1 << 12):
                pass
            os._exit(0)  # server 0 is gone (even killed): nothing here is worth keeping

        threading.Thread(target=watch_server_0, name="spillway-api-server-0-watch", daemon=True).start()
        os._exit(serve(index, link))

    def _watch(self) -> None:
        """Stop everything (SIGTERM to server 0) once a server exits on its own."""
        sentinels = {process.sentinel: process for process in self._processes}
        ended = wait(list(sentinels))
        deadline = time.monotonic() + 1.0
        while not self.serving and not self._stopping and time.monotonic() < deadline:
            time.sleep(0.05)  # a worker that failed to start ends every server: server 0 says why
        if self._stopping:
            return
        self.failed = self._ended(sentinels[ended[0]])
        logger.error("%s; the server stops", self.failed)
        os.kill(os.getpid(), signal.SIGTERM)

    def now_serving(self) -> None:
        """Server 0 serves: the others may listen too (`wait_serving` returns)."""
        self.serving = True
        self._serving.set()

    def wait_serving(self) -> None:
        """In servers 1..N-1: until server 0 serves (an exit of server 0 ends this process)."""
        self._serving.wait()

    def check(self) -> None:
        """RuntimeError if a server has exited (before server 0 serves: it failed to start)."""
        for process in self._processes:
            if not process.is_alive():
                raise RuntimeError(self._ended(process))

    @staticmethod
    def _ended(process) -> str:
        process.join(1)
        return f"API server {process.name.rsplit('-', 1)[-1]} {describe_exit(process.exitcode)}"

    def begin_stop(self) -> None:
        """SIGTERM to servers 1..count-1: uvicorn stops taking connections and finishes their
        streams (the worker must outlive them: `join`, then close it)."""
        self._stopping = True
        for process in self._processes:
            if process.is_alive():
                os.kill(process.pid, signal.SIGTERM)

    def join(self, timeout_s: float = STOP_GRACE_S) -> None:
        """Wait up to `timeout_s` for every server to exit."""
        deadline = time.monotonic() + timeout_s
        for process in self._processes:
            process.join(max(deadline - time.monotonic(), 0))

    def stop(self) -> None:
        """End servers 1..count-1 (SIGTERM, then SIGKILL after STOP_GRACE_S; SIGKILL at once if
        server 0 never served: they still wait for the worker, deaf to SIGTERM) and remove
        their links and metrics files. Idempotent."""
        if self.serving:
            self.begin_stop()
            self.join()
        self._stopping = True
        for process in self._processes:
            if process.is_alive():
                process.kill()
                process.join(5)
        for fd in (self._alive_read, self._alive_write):
            if fd >= 0:
                os.close(fd)
        self._alive_read = self._alive_write = -1
        shutil.rmtree(self._folder, ignore_errors=True)
