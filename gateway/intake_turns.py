"""Requests take their intake in turns, one per event-loop iteration.

A request's intake (decoding its body, building its Job, hashing its blocks, sending it to the
worker) runs on the event loop in one piece: ~1 ms for a 10k-id prompt. A burst of such
requests becomes ready in the same iteration, and asyncio runs everything ready at an
iteration's start before it polls its sockets again, so without turns a burst of 50 holds the
loop for ~50 ms in one go: the worker's first tokens for the requests already sent wait in the
socket until the whole burst is in (on a prefix the CPU tier loads for ~30 ms, every first
token then waited for the last request's intake).

With turns, at most one intake runs per iteration: between two, the loop polls its sockets,
so streams are written while a burst is still coming in. Turns go in order of arrival.

    iteration   k          k+1                      k+2
    runs        intake A   intake B, (worker read)  writes of the tokens read, intake C
"""

from __future__ import annotations

import asyncio
from collections import deque


class IntakeTurns:
    """`await turns.take()` returns when it is the caller's turn: the rest of the caller's run,
    up to its next await, is the iteration's one intake."""

    def __init__(self) -> None:
        self._waiting: deque[asyncio.Future[None]] = deque()
        self._taken = False  # a turn was given in this iteration: the next waits for the next one

    async def take(self) -> None:
        loop = asyncio.get_running_loop()
        if not self._taken and not self._waiting:
            self._give_next_iteration(loop)
            return
        turn = loop.create_future()
        self._waiting.append(turn)
        await turn  # a waiter cancelled meanwhile is skipped; one cancelled after its turn came loses it

    @property
    def waiting(self) -> int:
        return sum(not turn.done() for turn in self._waiting)

    def _give_next_iteration(self, loop: asyncio.AbstractEventLoop) -> None:
        """This iteration's turn is taken; the next waiter's comes with the next iteration."""
        self._taken = True
        loop.call_soon(self._pass_on, loop)

    def _pass_on(self, loop: asyncio.AbstractEventLoop) -> None:
        # Runs at the start of an iteration (scheduled by the one before): the waiter woken
        # here runs in the iteration after it, after what this one's socket poll woke.
        while self._waiting:
            turn = self._waiting.popleft()
            if not turn.done():
                turn.set_result(None)
                self._give_next_iteration(loop)
                return
        self._taken = False
