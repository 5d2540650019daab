"""The connections one server process holds, at most `limit` (gateway/http/file_handles.py derives
it from the file-handle limit), and which of them wait for a request's head.

At the bound a new connection is taken only once a held one has gone: the accepting server
(gateway/http/shared_accept.py) first closes the connection that has waited longest for its head
(a new connection that has sent nothing yet, a keep-alive one between requests, or a head
trickling in), so a stream of idle or half-sent connections cannot keep `/health` or a real
request out. Connections busy with a request are never closed to make room.

    accepted ──▶ held, waiting ──(head complete)──▶ held, busy ──(response sent)──▶ held, waiting
                    │ oldest of these closed at the bound                         ...  ──▶ released
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol


class Evictable(Protocol):
    def evict(self) -> None:
        """Close the connection to make room for another (its release follows)."""


class ConnectionBound:
    """Held connections (counted from their accept to their release) and those waiting for a
    head in the order they began waiting; `wake_when_room` is called once there may be room:
    a connection released, or one begun waiting that can be closed for room."""

    def __init__(self, limit: int) -> None:
        assert limit >= 1
        self.limit = limit
        self.held = 0
        self._waiting: OrderedDict[Evictable, None] = OrderedDict()
        self._wakers: list[Callable[[], None]] = []

    def full(self) -> bool:
        return self.held >= self.limit

    def taken(self) -> None:
        self.held += 1

    def released(self, connection: Evictable | None) -> None:
        self.held -= 1
        assert self.held >= 0
        if connection is not None:
            self._waiting.pop(connection, None)
        self._wake()

    def waiting(self, connection: Evictable) -> None:
        self._waiting[connection] = None
        self._wake()

    def busy(self, connection: Evictable) -> None:
        self._waiting.pop(connection, None)

    def num_waiting(self) -> int:
        return len(self._waiting)

    def evict_oldest_waiting(self) -> bool:
        """Close the connection waiting longest for its head; False if none waits."""
        if not self._waiting:
            return False
        connection, _ = self._waiting.popitem(last=False)
        connection.evict()
        return True

    def wake_when_room(self, callback: Callable[[], None]) -> None:
        self._wakers.append(callback)

    def _wake(self) -> None:
        if self._wakers:
            wakers, self._wakers = self._wakers, []
            for callback in wakers:
                callback()
