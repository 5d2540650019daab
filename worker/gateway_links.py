"""The worker's links to its gateways: one, or one per API server (`--api-server-count N`).

    link 0: the gateway that started the worker (or the remote gateway it connected to)
    link k: the API server k beside it, on the same port, with its own pair of sockets

Every link is a pair of ZeroMQ sockets the gateway binds (inbox PULL, outbox PUSH here). A
request belongs to the link its Generate came in on: its deltas go back there alone, and a
new HELLO session on a link aborts that link's requests only. What concerns every gateway (a
Ready at start, the worker's Stats, a fatal error) goes to every link.

Other sockets the busy loop waits on (a producer's KV server, a consumer's pull sockets:
worker/kv_transfer/) are polled with the links (`watch`), each with its handler, so a message on
any of them ends the wait; the handler takes it in place.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence

import zmq

from spillway.protocol.local.link_auth import LinkKeys, connect_sockets
from spillway.protocol.messages import RequestDelta


def take_messages(poller: zmq.Poller, socks: Sequence[zmq.Socket], timeout_ms: int, busy: Callable[[], bool],
                  budget_s: float, ready: Callable[[], bool] | None = None,
                  watched: Mapping[zmq.Socket, Callable[[], None]] | None = None) -> Iterator[tuple[int, bytes]]:
    """(link, message) of the messages waiting on `socks`, the first awaited up to `timeout_ms`,
    the links taken in turn; while `busy()`, only those taken within `budget_s` and, with
    `ready`, before `ready()` says a step has work (the rest stay queued for the next
    iteration). A `watched` socket the poller finds ready is handed to its handler instead."""
    index = {sock: link for link, sock in enumerate(socks)}
    deadline = None
    while events := poller.poll(timeout_ms):
        timeout_ms = 0
        for sock, _ in events:
            now = time.perf_counter()
            deadline = deadline or now + budget_s
            if (now > deadline or (ready is not None and ready())) and busy():
                return
            link = index.get(sock)
            if link is None:
                watched[sock]()
            else:
                yield link, sock.recv()


class GatewayLinks:
    """The sockets of every link, which link each request came from, and each link's session."""

    def __init__(self, ctx: zmq.Context, addresses: Sequence[tuple[str, str]], keys: LinkKeys | None = None) -> None:
        self.outbox_addresses = [outbox for _, outbox in addresses]  # the heartbeat's (worker/heartbeat.py)
        self.keys = keys
        self.inboxes: list[zmq.Socket] = []
        self.outboxes: list[zmq.Socket] = []
        for inbox, outbox in addresses:
            inp, out = connect_sockets(ctx, inbox, outbox, keys)
            self.inboxes.append(inp)
            self.outboxes.append(out)
        self.poller = zmq.Poller()
        for inp in self.inboxes:
            self.poller.register(inp, zmq.POLLIN)
        self.sessions: list[bytes | None] = [None] * len(addresses)  # each link's last HELLO session
        self._watched: dict[zmq.Socket, Callable[[], None]] = {}
        self._owners: dict[str, int] = {}  # request id -> its link, with more than one link

    def __len__(self) -> int:
        return len(self.inboxes)

    def take(self, timeout_ms: int, busy: Callable[[], bool], budget_s: float,
             ready: Callable[[], bool] | None = None) -> Iterator[tuple[int, bytes]]:
        return take_messages(self.poller, self.inboxes, timeout_ms, busy, budget_s, ready, self._watched)

    def watch(self, sock: zmq.Socket, handler: Callable[[], None]) -> None:
        """Poll `sock` with the links from now on; `handler()` takes in what it has (module doc)."""
        self.poller.register(sock, zmq.POLLIN)
        self._watched[sock] = handler

    def admit(self, request_id: str, link: int) -> None:
        """A request that came in on `link` (its outputs go back there)."""
        if len(self.outboxes) > 1:
            self._owners[request_id] = link

    def forget(self, link: int) -> list[str]:
        """The requests that came in on `link` and have not finished, forgotten (its gateway is
        gone: the caller aborts them)."""
        owned = [request_id for request_id, owner in self._owners.items() if owner == link]
        for request_id in owned:
            del self._owners[request_id]
        return owned

    def send_all(self, data: bytes) -> None:
        for out in self.outboxes:
            out.send(data)

    def route(self, outputs: list[RequestDelta]) -> list[list[RequestDelta]]:
        """`outputs` split by link, in order; a finished request is forgotten."""
        if len(self.outboxes) == 1:
            return [outputs]
        routed: list[list[RequestDelta]] = [[] for _ in self.outboxes]
        owners = self._owners
        for delta in outputs:
            link = owners.pop(delta.request_id, 0) if delta.finish_reason is not None \
                else owners.get(delta.request_id, 0)
            routed[link].append(delta)
        return routed
