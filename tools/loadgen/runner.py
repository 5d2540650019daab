"""Sends a workload at a load shape and collects one record per request.

Load shapes:
    closed loop  `concurrency` requests in flight: each finished request frees a slot at once
    open loop    arrivals at `request_rate` per second (gamma intervals: Poisson at burstiness 1),
                 optionally capped at `concurrency` in flight (a capped arrival waits for a slot)

A run ends by itself: after `num_requests` requests, or when `duration_s` has passed (no new
request starts after it; those in flight finish, each bounded by its own timeout).

A conversation's next turn is ready only when its previous turn has finished and, with a think
time, that turn's wait has passed (meanwhile the slot takes whatever else is ready, or opens
another conversation); at most `max_open_conversations` conversations are between turns at once
(the users of multi-turn).
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import httpx

from .client import RequestOptions, RequestRecord, request_body, send
from .workloads import Conversation


@dataclass(slots=True, frozen=True)
class LoadShape:
    concurrency: int | None = 1
    request_rate: float = math.inf
    burstiness: float = 1.0
    num_requests: int | None = None
    duration_s: float | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_requests is None and self.duration_s is None:
            raise ValueError("a run needs a request count, a duration, or both")
        if self.concurrency is None and math.isinf(self.request_rate):
            raise ValueError("give a concurrency, a finite request rate, or both")
        if self.burstiness <= 0:
            raise ValueError(f"burstiness must be > 0, got {self.burstiness}")

    def describe(self) -> str:
        parts = []
        if not math.isinf(self.request_rate):
            parts.append(f"{self.request_rate:g} req/s (burstiness {self.burstiness:g})")
        if self.concurrency is not None:
            parts.append(f"{'at most ' if parts else ''}{self.concurrency} in flight")
        if self.num_requests is not None:
            parts.append(f"{self.num_requests} requests")
        if self.duration_s is not None:
            parts.append(f"{'at most ' if self.num_requests else ''}{self.duration_s:g} s")
        return ", ".join(parts)


@dataclass(slots=True)
class Pending:
    """A request handed out by the dispatcher: a conversation's turn and the request's number."""

    index: int
    conversation: Conversation
    turn: int


class Dispatcher:
    """Hands out requests in order, holding back turns whose previous turn is still running."""

    def __init__(self, source: AsyncIterator[Conversation], num_requests: int | None,
                 deadline: float | None, max_open_conversations: int) -> None:
        self.source = source
        self.num_requests = num_requests
        self.deadline = deadline
        self.max_open = max_open_conversations
        self.issued = 0
        self.open = 0  # conversations waiting on a turn to finish before their next one
        self.exhausted = False
        self.ready: deque[tuple[Conversation, int]] = deque()
        self.changed = asyncio.Event()
        self._pulling = asyncio.Lock()

    def _time_left(self) -> float | None:
        return None if self.deadline is None else self.deadline - time.perf_counter()

    async def next(self) -> Pending | None:
        """The next request to send, waiting for a turn to become ready; None once the run is over."""
        while True:
            left = self._time_left()
            if (self.num_requests is not None and self.issued >= self.num_requests) or (left is not None and left <= 0):
                return None
            if self.ready:
                conversation, turn = self.ready.popleft()
                return self._issue(conversation, turn)
            if not self.exhausted and self.open < self.max_open:
                async with self._pulling:  # one reader of the source at a time; others re-check after
                    if not self.ready and not self.exhausted and self.open < self.max_open:
                        await self._pull()
                continue
            if self.open == 0:
                return None
            self.changed.clear()
            try:
                await asyncio.wait_for(self.changed.wait(), left)
            except asyncio.TimeoutError:
                return None

    async def _pull(self) -> None:
        try:
            conversation = await anext(self.source)
        except StopAsyncIteration:
            self.exhausted = True
            return
        if len(conversation.turns) > 1:
            self.open += 1
        self.ready.append((conversation, 0))

    def _issue(self, conversation: Conversation, turn: int) -> Pending:
        self.issued += 1
        return Pending(self.issued - 1, conversation, turn)

    def finished(self, pending: Pending, reply: str) -> None:
        conversation, following = pending.conversation, pending.turn + 1
        conversation.replies.append(reply)
        if following < len(conversation.turns):
            think_s = conversation.turns[following].think_s
            if think_s > 0:
                asyncio.get_running_loop().call_later(think_s, self._make_ready, conversation, following)
            else:
                self._make_ready(conversation, following)
            return
        if len(conversation.turns) > 1:
            self.open -= 1
        self.changed.set()

    def _make_ready(self, conversation: Conversation, turn: int) -> None:
        self.ready.append((conversation, turn))
        self.changed.set()


def arrival_gaps(rate: float, burstiness: float, seed: int):
    """Seconds between arrivals: gamma with mean 1/rate and shape `burstiness` (1 = Poisson)."""
    rng = random.Random(seed + 1)
    while True:
        yield 0.0 if math.isinf(rate) else rng.gammavariate(burstiness, 1.0 / (rate * burstiness))


class Runner:
    """Runs one load test; `on_done` is called after each request (for progress)."""

    def __init__(self, http: httpx.AsyncClient, options: RequestOptions, shape: LoadShape,
                 max_open_conversations: int, on_done: Callable[[RequestRecord], None] | None = None) -> None:
        self.http = http
        self.options = options
        self.shape = shape
        self.max_open = max_open_conversations
        self.on_done = on_done
        self.records: list[RequestRecord] = []
        self.t0 = 0.0

    async def run(self, source: AsyncIterator[Conversation], t0: float) -> list[RequestRecord]:
        self.t0 = t0
        deadline = t0 + self.shape.duration_s if self.shape.duration_s is not None else None
        dispatcher = Dispatcher(source, self.shape.num_requests, deadline, self.max_open)
        if math.isinf(self.shape.request_rate):
            await asyncio.gather(*(self._closed_loop(dispatcher) for _ in range(self.shape.concurrency)))
        else:
            await self._open_loop(dispatcher)
        self.records.sort(key=lambda r: r.index)
        return self.records

    async def _closed_loop(self, dispatcher: Dispatcher) -> None:
        while (pending := await dispatcher.next()) is not None:
            await self._one(dispatcher, pending)

    async def _open_loop(self, dispatcher: Dispatcher) -> None:
        slots = asyncio.Semaphore(self.shape.concurrency) if self.shape.concurrency else None
        tasks: set[asyncio.Task] = set()
        next_arrival = self.t0
        for gap in arrival_gaps(self.shape.request_rate, self.shape.burstiness, self.shape.seed):
            next_arrival += gap
            await asyncio.sleep(max(0.0, next_arrival - time.perf_counter()))
            if slots is not None:
                await slots.acquire()
            pending = await dispatcher.next()  # None only when the run is over: count, deadline or workload
            if pending is None:
                break
            task = asyncio.create_task(self._one(dispatcher, pending, slots))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.gather(*tasks)

    async def _one(self, dispatcher: Dispatcher, pending: Pending, slots: asyncio.Semaphore | None = None) -> None:
        conversation, turn = pending.conversation, pending.turn
        path, body = request_body(conversation, turn, self.options)
        record = RequestRecord(index=pending.index, conversation=conversation.index, turn=turn,
                               start_s=time.perf_counter() - self.t0,
                               expected_prompt_tokens=_expected_prompt_tokens(conversation, turn),
                               expected_output_tokens=conversation.turns[turn].output_len)
        try:
            reply = await send(self.http, path, body, record, self.options.timeout_s)
        finally:
            if slots is not None:
                slots.release()
        self.records.append(record)
        dispatcher.finished(pending, reply)
        if self.on_done is not None:
            self.on_done(record)


def _expected_prompt_tokens(conversation: Conversation, turn: int) -> int:
    """Tokens of the text this loadgen wrote (system and user turns); replies and templates add more."""
    system = conversation.system.num_tokens if conversation.system else 0
    return system + sum(t.user.num_tokens for t in conversation.turns[:turn + 1])
