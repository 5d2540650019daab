"""Connections on a listening socket that several API server processes share, taken one per
event-loop turn (`spillway serve --api-server-count N`, gateway/api_servers.py).

The event loops' own servers (asyncio's and uvloop's) accept every pending connection each time
the socket is ready, so the first process to wake took most of a burst: 50 connections made at
once went 30-50 to one of four servers, whose intake (~0.6-1.5 ms a 10k-id request) then held
the burst's last requests back by tens of milliseconds while the other servers had nothing to
do. Here a server accepts one connection per turn of its loop and handles whatever else is
ready before the next, so a server busy reading or checking a request leaves the next
connection to an idle one: a burst spreads over the servers by how busy each is.
Connections that come further apart find every server looking; for those the servers keep a
count of the connections each holds open (`OpenConnections`, shared memory made before they
fork): a server holding more than the fewest leaves a ready connection to the others for up to
MAX_DEFER_S, so a pool opened slowly and used all at once spreads too, as do long streams.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import multiprocessing
import select
import socket

import uvicorn

logger = logging.getLogger("spillway.gateway")

# accept() errors that mean "nothing for this process now": another server took it, or the
# client gave up before it was taken.
_NOT_NOW = {errno.EAGAIN, errno.EWOULDBLOCK, errno.ECONNABORTED, errno.EINTR, errno.EPROTO}
# After taking a connection a server leaves the socket to the others this long: a burst of
# connections made before their requests are sent (a client's pool) spreads over the idle
# servers too, rather than going to whichever woke first. A millisecond, uvloop's timer
# resolution (a shorter pause is no pause under it), about one 10k-id request's intake: up to
# 1,000 new connections a second per server; connections kept alive are not counted.
ACCEPT_INTERVAL_S = 0.001
# A server holding more open connections than another leaves a ready one to the others at most
# this long (then takes it: the others may all be busy with a long intake).
MAX_DEFER_S = 0.002


class OpenConnections:
    """The connections each of `count` API servers holds open, in memory shared by the
    processes forked after it is made; each server writes its own count only."""

    def __init__(self, count: int) -> None:
        self._counts = multiprocessing.get_context("fork").RawArray("q", count)

    def slot(self, index: int) -> ConnectionSlot:
        return ConnectionSlot(self._counts, index)

    def held(self) -> list[int]:
        """Each server's open connections now."""
        return self._counts[:]


class ConnectionSlot:
    """One server's count in `OpenConnections`."""

    def __init__(self, counts, index: int) -> None:
        self._counts, self.index = counts, index

    def opened(self) -> None:
        self._counts[self.index] += 1

    def closed(self) -> None:
        self._counts[self.index] -= 1

    def holds_more(self) -> bool:
        """Whether another server holds fewer connections than this one."""
        counts = self._counts[:]
        return counts[self.index] > min(counts)


def counted(protocol_class: type, slot: ConnectionSlot) -> type:
    """`protocol_class` (uvicorn's HTTP protocol) counting its connections in `slot` while open."""

    class Counted(protocol_class):
        _counted = False

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._counted = True
            slot.opened()

        def connection_lost(self, exc) -> None:
            if self._counted:
                self._counted = False
                slot.closed()
            super().connection_lost(exc)

    Counted.__name__ = Counted.__qualname__ = f"Counted{protocol_class.__name__}"
    return Counted


class OneAtATime:
    """Accepts one connection from `sock` per turn of `loop` and hands it to `protocol_factory`
    (uvicorn's HTTP protocol). Stands in for the `asyncio.Server` uvicorn keeps: `close()`
    stops accepting, `wait_closed()` returns once the connections taken are set up. With
    `slot` (the protocols count their connections there) a server holding more than another
    leaves a ready connection to the others, for MAX_DEFER_S at most."""

    def __init__(self, loop: asyncio.AbstractEventLoop, sock: socket.socket, protocol_factory,
                 backlog: int, slot: ConnectionSlot | None = None) -> None:
        self._loop, self._sock, self._factory, self._slot = loop, sock, protocol_factory, slot
        self._deferred_since: float | None = None  # a ready connection left to the others since
        self._starting: set[asyncio.Task] = set()
        sock.setblocking(False)
        sock.listen(backlog)
        loop.add_reader(sock.fileno(), self._accept_one)
        self._open = True
        self.num_accepted = 0

    def _accept_one(self) -> None:
        if self._slot is not None and self._slot.holds_more():
            now = self._loop.time()
            if self._deferred_since is None:
                self._deferred_since = now
            if now - self._deferred_since < MAX_DEFER_S:
                self._pause()
                return
        try:
            conn, _ = self._sock.accept()
        except OSError as exc:
            if exc.errno not in _NOT_NOW:  # out of descriptors, say: the connection waits in the backlog
                logger.warning("accepting a connection failed: %s", exc)
            return
        self.num_accepted += 1
        self._deferred_since = None
        self._pause()
        conn.setblocking(False)
        if conn.family in (socket.AF_INET, socket.AF_INET6):
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        task = self._loop.create_task(self._start(conn))
        self._starting.add(task)
        task.add_done_callback(self._starting.discard)

    def _pause(self) -> None:
        self._loop.remove_reader(self._sock.fileno())
        self._loop.call_later(ACCEPT_INTERVAL_S, self._resume)

    def _resume(self) -> None:
        if not self._open:
            return
        if self._deferred_since is not None and not select.select([self._sock], [], [], 0)[0]:
            self._deferred_since = None  # another server took what was left to it
        self._loop.add_reader(self._sock.fileno(), self._accept_one)

    async def _start(self, conn: socket.socket) -> None:
        try:
            await self._loop.connect_accepted_socket(self._factory, conn)
        except OSError as exc:  # the client went away between the accept and the set-up
            logger.debug("a connection closed while being set up: %s", exc)
            conn.close()

    def close(self) -> None:
        if self._open:
            self._open = False
            self._loop.remove_reader(self._sock.fileno())

    async def wait_closed(self) -> None:
        if self._starting:
            await asyncio.gather(*self._starting, return_exceptions=True)


class SharedSocketServer(uvicorn.Server):
    """uvicorn's server; with `shared` (other processes accept from its sockets too) it takes
    their connections one per turn (`OneAtATime`) instead of through the loop's own server,
    and with `slot` (its count among the servers' `OpenConnections`) leaves them to a server
    holding fewer."""

    def __init__(self, config: uvicorn.Config, shared: bool = True, slot: ConnectionSlot | None = None) -> None:
        super().__init__(config)
        self.shared = shared
        self.slot = slot

    async def startup(self, sockets=None) -> None:
        if not sockets or not self.shared:
            return await super().startup(sockets)
        await super().startup([])  # the lifespan and the server's state; no socket served yet
        if not self.started:
            return
        config, loop = self.config, asyncio.get_running_loop()

        protocol_class = config.http_protocol_class
        if self.slot is not None:
            protocol_class = counted(protocol_class, self.slot)

        def create_protocol(_loop=None) -> asyncio.Protocol:  # as uvicorn's own startup makes them
            return protocol_class(config=config, server_state=self.server_state, app_state=self.lifespan.state,
                                  _loop=_loop)

        self.servers = [OneAtATime(loop, sock, create_protocol, config.backlog, self.slot) for sock in sockets]
