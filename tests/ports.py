"""TCP ports for tests that start servers, without the race of "find a free port, close it,
bind it later": meanwhile another process (a parallel test run, an outgoing connection
that takes it as its source port) may take it, and the server fails with EADDRINUSE.

- `listening_socket()`: a socket already bound and listening, handed to a server in this
  process (uvicorn's `Server.run(sockets=[...])`).
- `reserve_ports(count)`: for a server that binds by number (a subprocess, ZeroMQ). The
  ports are held by bound, non-listening sockets: the kernel gives a bound port to neither
  `bind(port 0)` nor an outgoing connection, and a plain bind to it fails. Each is bound
  without SO_REUSEADDR, so two reservations never share a port, then has SO_REUSEADDR set,
  so a listener that sets it too (ZeroMQ, asyncio and uvicorn all do) can bind the port
  while the reservation holds it (Linux allows that while the holder does not listen).
"""

from __future__ import annotations

import errno
import socket

HOST = "127.0.0.1"


def listening_socket() -> socket.socket:
    """A TCP socket bound to a port of the kernel's choosing on HOST, listening."""
    sock = socket.socket()
    sock.bind((HOST, 0))
    sock.listen(128)
    return sock


class PortReservation:
    """`ports`: consecutive ports on HOST, held until `close` (see module doc)."""

    def __init__(self, count: int, attempts: int = 100) -> None:
        self._held = _bind_consecutive(count, attempts)
        for sock in self._held:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.ports = [sock.getsockname()[1] for sock in self._held]

    def close(self) -> None:
        for sock in self._held:
            sock.close()

    def __enter__(self) -> list[int]:
        return self.ports

    def __exit__(self, *exc_info) -> None:
        self.close()


def reserve_ports(count: int = 1) -> PortReservation:
    """`with reserve_ports(2) as (port, next_port): ...`"""
    return PortReservation(count)


def _bind_consecutive(count: int, attempts: int) -> list[socket.socket]:
    for _ in range(attempts):
        first = socket.socket()
        first.bind((HOST, 0))
        held = [first]
        port = first.getsockname()[1]
        try:
            if port + count - 1 > 65535:
                raise OSError(errno.EADDRINUSE, "the range runs past the last port")
            for offset in range(1, count):
                sock = socket.socket()
                held.append(sock)
                sock.bind((HOST, port + offset))
            return held
        except OSError as exc:
            for sock in held:
                sock.close()
            if exc.errno not in (errno.EADDRINUSE, errno.EACCES):
                raise
    raise RuntimeError(f"no {count} consecutive free ports in {attempts} attempts")
