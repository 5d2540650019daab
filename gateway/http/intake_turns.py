"""Requests take their intake in turns: an event-loop iteration runs a bounded share of a burst.

A request's intake (decoding its body, building its Job, hashing its blocks, sending it to the
worker) runs on the event loop in one piece: ~1 ms for a 10k-id prompt (58 KB of JSON), tens
of microseconds for a short one. A burst of requests becomes ready in the same iteration, and
asyncio runs everything ready at an iteration's start before it polls its sockets again, so
without turns a burst of 50 long prompts holds the loop for ~50 ms in one go: the worker's first
tokens for the requests already sent wait in the socket until the whole burst is in (on a
prefix the CPU tier loads for ~30 ms, every first token then waited for the last intake).

With turns, an iteration's intakes stop at a budget of request-body bytes (each request counted
with REQUEST_BYTES more, for what any request costs): the requests left wait for the next
iteration, in order of arrival, and between two iterations the loop polls its sockets, so
streams are written while a burst is still coming in. The first intake of an iteration goes
whatever its size.

The budget grows with the streams the loop serves: between two windows of intake the loop
writes every stream that has tokens (~30 us each), so a window of STREAM_BYTES per stream
(~30 us of intake) keeps about half the loop for the burst. 256 streams: ~130 short requests a
window, a burst of them in two; a few dozen: one 10k-id prompt (~1 ms) a window.

    iteration   k               k+1                         k+2
    runs        intake A        sockets polled: the         streams written,
                (B, C: 58 KB    worker's tokens read;       intake B
                each, wait)     B let go                    (C waits)
"""

from __future__ import annotations

import asyncio
from collections import deque

INTAKE_BUDGET_BYTES = 64 << 10  # at least: about one 10k-id prompt (~1 ms), or ~20 short requests
REQUEST_BYTES = 2 << 10
STREAM_BYTES = 1536


class IntakeTurns:
    """`await turns.take(body_bytes)` returns when it is the caller's turn: the rest of the
    caller's run, up to its next await, is one of its iteration's intakes."""

    def __init__(self, budget_bytes: int = INTAKE_BUDGET_BYTES, num_streams=lambda: 0) -> None:
        self.min_budget_bytes = budget_bytes
        self._num_streams = num_streams  # the streams open now (EngineClient.num_in_flight)
        self._waiting: deque[tuple[asyncio.Future[None], int]] = deque()
        self._spent: int | None = None  # this iteration's intake bytes; None: no intake yet
        self._window_call = False  # a `_next_window` is scheduled

    async def take(self, body_bytes: int) -> None:
        loop = asyncio.get_running_loop()
        cost = body_bytes + REQUEST_BYTES
        if not self._waiting and (self._spent is None or self._spent + cost <= self.budget_bytes):
            self._spend(loop, cost)
            return
        turn = loop.create_future()
        self._waiting.append((turn, cost))
        self._schedule_window(loop)
        await turn  # a waiter cancelled before its turn is skipped; one cancelled after loses it

    @property
    def budget_bytes(self) -> int:
        return max(self.min_budget_bytes, STREAM_BYTES * self._num_streams())

    @property
    def waiting(self) -> int:
        return sum(not turn.done() for turn, _ in self._waiting)

    def _spend(self, loop: asyncio.AbstractEventLoop, cost: int) -> None:
        if self._spent is None:  # the first intake of an iteration
            self._spent = 0
            self._schedule_window(loop)
        self._spent += cost

    def _schedule_window(self, loop: asyncio.AbstractEventLoop) -> None:
        if not self._window_call:
            self._window_call = True
            loop.call_soon(self._next_window, loop)

    def _next_window(self, loop: asyncio.AbstractEventLoop) -> None:
        # Runs at the start of the iteration after it was scheduled: the waiters let go here
        # run in the iteration after this one (after what this one's socket poll woke), and
        # the next window opens behind them.
        self._window_call = False
        spent, budget = None, self.budget_bytes
        while self._waiting:
            turn, cost = self._waiting[0]
            if turn.done():  # cancelled while waiting
                self._waiting.popleft()
                continue
            if spent is not None and spent + cost > budget:
                break
            self._waiting.popleft()
            turn.set_result(None)
            spent = (spent or 0) + cost
        self._spent = spent
        if spent is not None:
            self._schedule_window(loop)
