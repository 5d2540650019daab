"""Connections on a listening socket that several API server processes share, taken one per
event-loop turn (`spillway serve --api-server-count N`, gateway/http/api_servers.py).

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

A server alone on its socket takes every waiting connection at once, as the loop's server
would, through the same `Acceptor`: either way it holds at most the connections its file
handles leave room for (gateway/http/connection_bound.py), and an accept() that fails for want of
a handle (EMFILE) pauses it instead of leaving it to poll a socket it cannot take from.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import multiprocessing
import select
import socket

import uvicorn

from spillway.gateway.http.connection_bound import ConnectionBound
from spillway.gateway.http.file_handles import connection_limit

logger = logging.getLogger("spillway.gateway")

# accept() errors that mean "nothing for this process now": another server took it, or the
# client gave up before it was taken.
_NOT_NOW = {errno.EAGAIN, errno.EWOULDBLOCK, errno.ECONNABORTED, errno.EINTR, errno.EPROTO}
# After taking a connection a server leaves the socket to the others this long: a burst of
# connections made before their requests are sent (a client's pool) spreads over the idle
# servers too, rather than going to whichever woke first. One tick of uvloop's timer, which
# counts whole milliseconds (libuv's loop time): the shortest pause there is, whatever the
# machine. Up to 1,000 new connections a second per server; connections kept alive are not counted.
ACCEPT_INTERVAL_S = 0.001
# A server holding more open connections than another leaves a ready one to the others for two
# of its pauses at most (then takes it: the others may all be busy with a long intake).
MAX_DEFER_S = 2 * ACCEPT_INTERVAL_S
# accept() failed for want of a file handle, with no connection of this server's to close:
# asyncio's own servers wait this long before they try again.
ACCEPT_RETRY_S = 1.0


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


def bounded(protocol_class: type, bound: ConnectionBound) -> type:
    """`protocol_class` releasing its place in `bound` when its connection goes (the accept took
    it); a BoundedHeadProtocol also tells the bound when it waits for a head."""

    class Bounded(protocol_class):
        def connection_lost(self, exc) -> None:
            super().connection_lost(exc)
            bound.released(self)

    Bounded.bound = bound
    Bounded.__name__ = Bounded.__qualname__ = f"Bounded{protocol_class.__name__}"
    return Bounded


class Acceptor:
    """Accepts connections from `sock` and hands each to `protocol_factory` (uvicorn's HTTP
    protocol). Stands in for the `asyncio.Server` uvicorn keeps: `close()` stops accepting,
    `wait_closed()` returns once the connections taken are set up.

    With `one_per_turn` (the socket is shared with other servers) it takes one connection per
    turn of `loop`, then pauses ACCEPT_INTERVAL_S; else all that wait. With `slot` (the
    protocols count their connections there) a server holding more than another leaves a ready
    connection to the others, for MAX_DEFER_S at most. With `bound` (the protocols release
    their places in it) it holds at most `bound.limit` connections: at the bound it closes the
    one waiting longest for a head and takes the new one once that has gone, or, if none waits,
    once any goes. It never polls a socket it cannot take from: out of file handles (EMFILE),
    it waits for a connection to go, or ACCEPT_RETRY_S."""

    def __init__(self, loop: asyncio.AbstractEventLoop, sock: socket.socket, protocol_factory,
                 backlog: int, slot: ConnectionSlot | None = None, bound: ConnectionBound | None = None,
                 one_per_turn: bool = True) -> None:
        self._loop, self._sock, self._factory, self._slot = loop, sock, protocol_factory, slot
        self._bound, self._one_per_turn, self._backlog = bound, one_per_turn, backlog
        self._deferred_since: float | None = None  # a ready connection left to the others since
        self._starting: set[asyncio.Task] = set()
        self._reading = False
        self._paused: asyncio.TimerHandle | None = None  # the resume after a pause, if one is due
        self._out_of_handles = False  # accept() last failed for want of a file handle
        sock.setblocking(False)
        sock.listen(backlog)
        self._open = True
        self.num_accepted = 0
        self._watch()

    def _on_ready(self) -> None:
        if self._one_per_turn and self._slot is not None and self._slot.holds_more():
            now = self._loop.time()
            if self._deferred_since is None:
                self._deferred_since = now
            if now - self._deferred_since < MAX_DEFER_S:
                self._pause(ACCEPT_INTERVAL_S)
                return
        for _ in range(1 if self._one_per_turn else self._backlog):
            if self._bound is not None and self._bound.full():
                self._bound.evict_oldest_waiting()  # its release wakes this
                self._wait_for_room()
                return
            try:
                conn, _ = self._sock.accept()
            except OSError as exc:
                if exc.errno not in _NOT_NOW:
                    self._accept_failed(exc)
                return
            self._take(conn)
        if self._one_per_turn:
            self._pause(ACCEPT_INTERVAL_S)

    def _take(self, conn: socket.socket) -> None:
        self.num_accepted += 1
        self._deferred_since = None
        if self._out_of_handles:
            self._out_of_handles = False
            logger.info("accepting connections again")
        if self._bound is not None:
            self._bound.taken()
        conn.setblocking(False)
        if conn.family in (socket.AF_INET, socket.AF_INET6):
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        task = self._loop.create_task(self._start(conn))
        self._starting.add(task)
        task.add_done_callback(self._starting.discard)

    def _accept_failed(self, exc: OSError) -> None:
        """Out of file handles, say: the connection waits in the backlog until one is free. A
        listening socket stays ready meanwhile, so watching it would spin."""
        if not self._out_of_handles:
            self._out_of_handles = True
            logger.warning("accepting a connection failed: %s; retrying once a connection closes or in %g s",
                           exc, ACCEPT_RETRY_S)
        if self._bound is not None and exc.errno in (errno.EMFILE, errno.ENFILE):
            self._bound.evict_oldest_waiting()  # a handle for the next accept (the bound's reserve is spent)
            self._wait_for_room()
        self._pause(ACCEPT_RETRY_S)

    def _watch(self) -> None:
        if self._open and not self._reading:
            self._reading = True
            self._loop.add_reader(self._sock.fileno(), self._on_ready)

    def _unwatch(self) -> None:
        if self._reading:
            self._reading = False
            self._loop.remove_reader(self._sock.fileno())

    def _wait_for_room(self) -> None:
        self._unwatch()
        self._bound.wake_when_room(self._room)

    def _room(self) -> None:
        if self._paused is not None:  # the retry after EMFILE: a connection gone frees a handle sooner
            self._paused.cancel()
            self._paused = None
        self._watch()

    def _pause(self, delay_s: float) -> None:
        self._unwatch()
        if self._paused is None:
            self._paused = self._loop.call_later(delay_s, self._resume)

    def _resume(self) -> None:
        self._paused = None
        if not self._open:
            return
        if self._deferred_since is not None and not select.select([self._sock], [], [], 0)[0]:
            self._deferred_since = None  # another server took what was left to it
        self._watch()

    async def _start(self, conn: socket.socket) -> None:
        try:
            await self._loop.connect_accepted_socket(self._factory, conn)
        except OSError as exc:  # the client went away between the accept and the set-up
            logger.debug("a connection closed while being set up: %s", exc)
            conn.close()
            if self._bound is not None:
                self._bound.released(None)

    def close(self) -> None:
        if self._open:
            self._unwatch()
            self._open = False
            if self._paused is not None:
                self._paused.cancel()
                self._paused = None

    async def wait_closed(self) -> None:
        if self._starting:
            await asyncio.gather(*self._starting, return_exceptions=True)


class SharedSocketServer(uvicorn.Server):
    """uvicorn's server taking its connections through an `Acceptor` rather than the loop's own
    server: it holds at most `connection_limit()` (gateway/http/file_handles.py). With `shared`
    (other processes accept from its sockets too) it takes them one per turn, and with `slot`
    (its count among the servers' `OpenConnections`) leaves them to a server holding fewer."""

    def __init__(self, config: uvicorn.Config, shared: bool = True, slot: ConnectionSlot | None = None) -> None:
        super().__init__(config)
        self.shared = shared
        self.slot = slot
        self.bound: ConnectionBound | None = None

    async def startup(self, sockets=None) -> None:
        if not sockets:
            return await super().startup(sockets)
        await super().startup([])  # the lifespan and the server's state; no socket served yet
        if not self.started:
            return
        config, loop = self.config, asyncio.get_running_loop()
        # Counted once the worker link and the app's files are open: what is left is for connections.
        self.bound = ConnectionBound(connection_limit())
        protocol_class = bounded(config.http_protocol_class, self.bound)
        if self.slot is not None:
            protocol_class = counted(protocol_class, self.slot)

        def create_protocol(_loop=None) -> asyncio.Protocol:  # as uvicorn's own startup makes them
            return protocol_class(config=config, server_state=self.server_state, app_state=self.lifespan.state,
                                  _loop=_loop)

        self.servers = [Acceptor(loop, sock, create_protocol, config.backlog, self.slot, self.bound,
                                 one_per_turn=self.shared) for sock in sockets]
