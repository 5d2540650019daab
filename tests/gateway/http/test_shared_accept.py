"""API servers sharing one listening socket take its connections one per turn of their event
loop (gateway/http/shared_accept.py): a server takes one and leaves the next to the others, a burst
of connections spreads over the servers instead of going to whichever woke first, a server
holding more connections than another leaves new ones to it, and a closed server takes no more."""

from __future__ import annotations

import asyncio
import collections
import multiprocessing
import os
import signal
import socket
import sys
import time
from pathlib import Path

from spillway.gateway.http import shared_accept
from spillway.gateway.http.shared_accept import Acceptor, OpenConnections

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from spillway.tools.bench.serve.accept import ask, serve  # noqa: E402  (servers answering with their pid)


def listening_socket() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    return sock


def test_one_connection_per_turn_then_a_pause(monkeypatch):
    monkeypatch.setattr(shared_accept, "ACCEPT_INTERVAL_S", 0.2)  # long enough to see the turns in it

    async def scenario() -> list[int]:
        loop = asyncio.get_running_loop()
        sock = listening_socket()
        clients = [socket.create_connection(sock.getsockname()) for _ in range(3)]  # all in the backlog
        server = Acceptor(loop, sock, asyncio.Protocol, backlog=128)
        counts = []
        for _ in range(5):  # the first turns: the socket polled, one taken, then the pause
            await asyncio.sleep(0)
        counts.append(server.num_accepted)
        await asyncio.sleep(0.3)  # halfway between the second accept (0.2 s) and the third (0.4 s)
        counts.append(server.num_accepted)  # one more after the pause
        await asyncio.sleep(0.3)
        counts.append(server.num_accepted)
        server.close()
        late = socket.create_connection(sock.getsockname())
        await asyncio.sleep(0.45)
        counts.append(server.num_accepted)  # closed: the late one stays in the backlog
        await server.wait_closed()
        for client in [*clients, late]:
            client.close()
        sock.close()
        return counts

    assert asyncio.run(scenario()) == [1, 2, 3, 3]


class Holding:
    """A slot whose server holds more connections than another (`more`) or not."""

    def __init__(self, more: bool) -> None:
        self.more = more

    def holds_more(self) -> bool:
        return self.more


def test_a_server_holding_more_leaves_a_ready_connection_to_the_others_for_a_while(monkeypatch):
    monkeypatch.setattr(shared_accept, "ACCEPT_INTERVAL_S", 0.05)
    monkeypatch.setattr(shared_accept, "MAX_DEFER_S", 0.3)

    async def accepted_after(more: bool, waits: list[float]) -> list[int]:
        loop = asyncio.get_running_loop()
        sock = listening_socket()
        client = socket.create_connection(sock.getsockname())
        server = Acceptor(loop, sock, asyncio.Protocol, backlog=128, slot=Holding(more))
        counts = []
        for wait in waits:
            await asyncio.sleep(wait)
            counts.append(server.num_accepted)
        server.close()
        await server.wait_closed()
        client.close()
        sock.close()
        return counts

    assert asyncio.run(accepted_after(True, [0.15, 0.35])) == [0, 1]  # nobody else took it: taken at 0.3 s
    assert asyncio.run(accepted_after(False, [0.02])) == [1]


def test_connections_are_counted_while_open():
    async def scenario() -> list[int]:
        loop = asyncio.get_running_loop()
        connections = OpenConnections(2)
        protocol_class = shared_accept.counted(asyncio.Protocol, connections.slot(1))
        ours, theirs = socket.socketpair()
        held = [connections.held()[1]]
        transport, _ = await loop.connect_accepted_socket(protocol_class, ours)
        held.append(connections.held()[1])
        theirs.close()  # the client goes: the transport sees EOF and closes
        await asyncio.sleep(0.05)
        held.append(connections.held()[1])
        transport.close()
        return held

    assert asyncio.run(scenario()) == [0, 1, 0]


async def burst(port: int, count: int, servers: list) -> collections.Counter:
    """`count` connections made while every server is stopped, so all of them wait in the
    backlog when the servers go on (a client's pool opened at once); then one request on each."""
    for server in servers:
        os.kill(server.pid, signal.SIGSTOP)
    try:
        connections = await asyncio.gather(*(asyncio.open_connection("127.0.0.1", port) for _ in range(count)))
    finally:
        for server in servers:
            os.kill(server.pid, signal.SIGCONT)
    await asyncio.sleep(0.1)

    return collections.Counter(await asyncio.gather(*(ask(*connection) for connection in connections)))


def test_a_burst_spreads_over_the_servers():
    """Connections already waiting when the servers look go one per server per turn. (Ones that
    come more than a millisecond apart go to whichever server wakes first: nothing waits then.)"""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    context = multiprocessing.get_context("fork")
    servers = [context.Process(target=serve, args=(sock,), daemon=True) for _ in range(4)]
    for server in servers:
        server.start()
    try:
        deadline = time.monotonic() + 30
        while True:  # listening; the burst waits in the backlog for the servers still starting
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "the servers did not start"
                time.sleep(0.1)
        time.sleep(1)
        for _ in range(2):
            taken = asyncio.run(burst(port, 40, servers))
            assert sum(taken.values()) == 40
            # The loops' own servers gave 20-40 of such a burst to one process and none to one or more.
            assert len(taken) == 4 and max(taken.values()) <= 16, taken
    finally:
        for server in servers:
            server.terminate()
            server.join(10)
        sock.close()


def test_new_connections_go_to_the_servers_holding_fewer():
    """Server 0 alone takes 8 connections (the others stopped), then 24 more come 2 ms apart
    with every server looking: the other three take them, and every count goes back to 0 once
    the clients close. Without the counts each server would take about a quarter of them."""
    counts = OpenConnections(4)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    address = sock.getsockname()
    context = multiprocessing.get_context("fork")
    servers = [context.Process(target=serve, args=(sock, counts.slot(index)), daemon=True) for index in range(4)]
    for server in servers:
        server.start()
    def wait_for(condition, what: str) -> None:
        deadline = time.monotonic() + 20
        while not condition():
            assert time.monotonic() < deadline, f"{what}: {counts.held()}"
            time.sleep(0.01)

    clients = []
    try:
        time.sleep(1)  # every server listening (a connection made before waits in the backlog anyway)
        for server in servers[1:]:
            os.kill(server.pid, signal.SIGSTOP)
        try:
            clients += [socket.create_connection(address) for _ in range(8)]
            wait_for(lambda: counts.held()[0] == 8, "server 0 took the first 8")
        finally:
            for server in servers[1:]:
                os.kill(server.pid, signal.SIGCONT)
        for _ in range(24):
            clients.append(socket.create_connection(address))
            time.sleep(0.002)
        wait_for(lambda: sum(counts.held()) == 32, "all 32 taken")
        held = counts.held()
        assert held[0] <= 9 and min(held[1:]) >= 7, held  # [8, 8, 8, 8] in every run; ~[12, 6, 7, 7] without
        for client in clients:
            client.close()
        wait_for(lambda: counts.held() == [0, 0, 0, 0], "closed connections uncounted")
    finally:
        for client in clients:
            client.close()
        for server in servers:
            server.terminate()
            server.join(10)
        sock.close()
