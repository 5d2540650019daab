"""The life of a `spillway serve` process: its port taken before anything slow, a banner once
it serves, and a quiet end on Ctrl-C or SIGTERM.

    bind HOST:PORT ──▶ start the worker (model load) ──▶ uvicorn on that socket ──▶ banner
    SIGINT / SIGTERM at any point ──▶ worker closed, exit status 0, no traceback

The socket is bound first, so a port in use ends the command in a moment rather than after
the model has loaded, and no other process can take the port in between.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from contextlib import contextmanager

import uvicorn

logger = logging.getLogger("spillway.gateway")


class PortInUse(OSError):
    """The port cannot be bound: another process listens on it, or it is not this host's."""


class Stopped(BaseException):
    """SIGTERM arrived: unwinds like Ctrl-C's KeyboardInterrupt, whatever the process was doing."""


def bind_port(host: str, port: int) -> socket.socket:
    """A socket bound to host:port, for uvicorn to listen on; PortInUse naming both otherwise."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        raise PortInUse(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart need not wait for TIME_WAIT
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise PortInUse(f"cannot listen on {host}:{port}: port {port} is in use or not available "
                        f"({exc.strerror}); choose another with --port") from None
    return sock


class BannerServer(uvicorn.Server):
    """uvicorn's server, which says once it serves where and what. With `api_servers` (the
    other API servers on its port) its shutdown waits for theirs before its own, which closes
    the worker they use."""

    def __init__(self, config: uvicorn.Config, model_name: str, api_servers=None) -> None:
        super().__init__(config)
        self.model_name = model_name
        self.api_servers = api_servers

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:
            if self.api_servers is not None:
                self.api_servers.now_serving()
            host = f"[{self.config.host}]" if ":" in self.config.host else self.config.host
            count = f" with {self.api_servers.count} API server processes" if self.api_servers is not None else ""
            logger.info("Spillway serves %s at http://%s:%d%s (OpenAI-compatible API under /v1); "
                        "Ctrl-C to stop", self.model_name, host, self.config.port, count)

    async def shutdown(self, sockets=None) -> None:
        if self.api_servers is not None:
            self.api_servers.begin_stop()
            await asyncio.to_thread(self.api_servers.join)
        await super().shutdown(sockets)


@contextmanager
def stop_on_sigterm():
    """SIGTERM raises Stopped, as SIGINT raises KeyboardInterrupt, until the block ends.

    uvicorn handles both while it serves, then raises the signal again once it has shut
    down; this handler turns that second SIGTERM into an ordinary return."""

    def on_sigterm(signum, frame) -> None:
        raise Stopped()

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
