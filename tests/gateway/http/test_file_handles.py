"""File handles: `spillway serve` raises its soft limit to the hard one at start; a server whose
hard limit is low holds a bounded number of connections and closes the one waiting longest for
its head to take a new one, so `/health` answers under a flood of half-sent requests; an
accept() out of handles (EMFILE) pauses the accepting instead of spinning on it."""

from __future__ import annotations

import asyncio
import errno
import os
import re
import resource
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from fake_serve import FakeServeProcess
from ports import HOST, reserve_ports
from server_helpers import spillway_command
from spillway.gateway.http import shared_accept
from spillway.gateway.http.connection_bound import ConnectionBound
from spillway.gateway.http.shared_accept import Acceptor


def open_files_limits(pid: int) -> tuple[int, int]:
    """(soft, hard) RLIMIT_NOFILE of process `pid`, as /proc/<pid>/limits shows them."""
    text = Path(f"/proc/{pid}/limits").read_text()
    soft, hard = re.search(r"^Max open files\s+(\d+)\s+(\d+)", text, re.MULTILINE).groups()
    return int(soft), int(hard)


def test_spillway_serve_raises_its_soft_file_handle_limit_to_the_hard_one_at_start():
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert hard > 512
    with reserve_ports(1) as (port,), tempfile.NamedTemporaryFile(suffix=".log") as log:
        process = subprocess.Popen(
            [*spillway_command(), "serve", "--port", str(port)], stdout=log, stderr=subprocess.STDOUT,
            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (512, hard)), start_new_session=True)
        try:
            limits, deadline = open_files_limits(process.pid), time.monotonic() + 30
            while limits[0] != hard and time.monotonic() < deadline and process.poll() is None:
                time.sleep(0.1)
                limits = open_files_limits(process.pid)
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)
        output = Path(log.name).read_text()
    assert limits == (hard, hard), output[-2000:]
    if hard < 65536:  # this machine's: the server says how few connections that leaves
        assert f"the open-file limit is {hard} (hard limit {hard})" in output, output[-2000:]


def limit_file_handles(count: int):
    return lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (count, count))


def test_health_answers_under_1100_half_open_connections_at_a_1024_handle_limit():
    """Without the bound the server took connections until accept() failed with EMFILE, and
    every /health after that failed."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = 1100 + 100  # the clients' own handles
    if soft < needed:  # as the server does for itself
        wanted = 4 * needed if hard == resource.RLIM_INFINITY else min(hard, 4 * needed)
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] >= needed
    server = FakeServeProcess("--timeout-request-head", "600", preexec_fn=limit_file_handles(1024))
    half_open = []
    try:
        server.wait_healthy()
        for _ in range(1100):
            sock = socket.create_connection((HOST, server.port))
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # the head's last line never comes
            half_open.append(sock)
        time.sleep(1)  # the server has taken what it can
        statuses = []
        for _ in range(30):
            try:
                statuses.append(httpx.get(server.url + "/health", timeout=5).status_code)
            except httpx.TransportError as exc:
                statuses.append(type(exc).__name__)
        held_handles = len(os.listdir(f"/proc/{server.process.pid}/fd"))
    finally:
        for sock in half_open:
            sock.close()
        output = server.stop()
    assert statuses == [200] * 30, output[-3000:]
    assert held_handles < 1024
    assert "Too many open files" not in output, output[-3000:]


class OutOfHandles(socket.socket):
    """A listening socket whose accept() fails with EMFILE while `out` is set."""

    out = True
    accept_calls = 0

    def accept(self):
        self.accept_calls += 1
        if self.out:
            raise OSError(errno.EMFILE, "Too many open files")
        return super().accept()


def test_accepting_out_of_file_handles_waits_instead_of_spinning(monkeypatch):
    """The socket stays ready while its connection waits: polled again at once, accept() would
    fail tens of thousands of times a second."""
    monkeypatch.setattr(shared_accept, "ACCEPT_RETRY_S", 0.2)

    async def scenario() -> tuple[int, int, int]:
        loop = asyncio.get_running_loop()
        sock = OutOfHandles()
        sock.bind((HOST, 0))
        sock.listen(128)
        client = socket.create_connection(sock.getsockname())
        server = Acceptor(loop, sock, asyncio.Protocol, backlog=128, one_per_turn=False)
        await asyncio.sleep(0.5)  # tried at 0, 0.2 and 0.4 s
        calls_while_out, accepted_while_out = sock.accept_calls, server.num_accepted
        sock.out = False
        await asyncio.sleep(0.3)
        server.close()
        await server.wait_closed()
        client.close()
        sock.close()
        return calls_while_out, accepted_while_out, server.num_accepted

    assert asyncio.run(scenario()) == (3, 0, 1)


class Connection:
    def __init__(self, name: str, evicted: list[str]) -> None:
        self.name, self._evicted = name, evicted

    def evict(self) -> None:
        self._evicted.append(self.name)


def test_the_bound_closes_the_connection_waiting_longest_for_its_head():
    evicted: list[str] = []
    bound = ConnectionBound(limit=3)
    fresh, kept_alive, busy = (Connection(name, evicted) for name in ("fresh", "kept-alive", "busy"))
    for connection in (busy, fresh, kept_alive):
        bound.taken()
        bound.waiting(connection)
    bound.busy(busy)  # its head came: it is serving a request
    assert bound.full() and bound.num_waiting() == 2
    assert bound.evict_oldest_waiting() and bound.evict_oldest_waiting()
    assert evicted == ["fresh", "kept-alive"]
    assert not bound.evict_oldest_waiting()  # the busy one is never closed for room
    woken = []
    bound.wake_when_room(lambda: woken.append(bound.held))
    bound.released(fresh)
    assert woken == [2] and not bound.full()
