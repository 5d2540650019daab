"""The gateway's asynchronous client of its worker: requests in, deltas routed back.

    handler ── submit(Generate, ...) ─────────────────▶ WorkerLink ──▶ worker
    handler ◀── RequestStream queue ◀── on_step (the link's one reader task) ◀──┘

One reader task decodes every `StepOutputs` and routes each `RequestDelta` to the queue of the
HTTP request that owns it; handlers only await their own queue. When the worker dies, every
in-flight request gets `WorkerLost` at once and new ones get `EngineUnavailable` (503) until
the replacement is ready. Admission is bounded: `EngineOverloaded` (429) past `max_pending`.
No request waits for the worker forever: one that hears nothing of it for `response_timeout_s`
is aborted and gets `WorkerTimeout` (a sweep, so the hot path pays one attribute store).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from spillway.gateway.metrics.engine_metrics import EngineMetrics
from spillway.gateway.metrics.metrics import observe_repeated
from spillway.gateway.metrics.request_metrics import RequestTimes
from spillway.gateway.link.worker_link import LinkState, WorkerLink
from spillway.protocol.hashing import num_token_ids
from spillway.protocol.messages import (
    Abort,
    Control,
    ControlCommand,
    FinishReason,
    Generate,
    KvEvents,
    KvSourceLost,
    Ready,
    RequestDelta,
    Stats,
    StepOutputs,
    WORKER_SILENCE_TIMEOUT_S,
)


class EngineUnavailable(Exception):
    """No worker can take requests right now (starting, restarting or shut down): 503."""


class EngineOverloaded(Exception):
    """Too many sequences in flight: 429."""


class WorkerLost(Exception):
    """The worker died while this request was in flight."""


class WorkerTimeout(WorkerLost):
    """The worker said nothing about this request for longer than the client's bound."""


DEFAULT_RESPONSE_TIMEOUT_S = 1800.0  # vLLM has no bound: this one lets a long queue wait and a long prefill run
# A worker that beats four times a second (worker/heartbeat.py) and is silent this long is
# stopped or frozen (the protocol's bound: worker-to-worker waits follow it too).
DEFAULT_HEARTBEAT_TIMEOUT_S = WORKER_SILENCE_TIMEOUT_S
# One step this long is stuck: it is far past a prefill of a full token budget on a CPU, or the
# first step of a model whose kernels compile (vLLM's VLLM_ENGINE_ITERATION_TIMEOUT_S is 60 s).
DEFAULT_STEP_TIMEOUT_S = 600.0


@dataclass(slots=True)
class _Tracked:
    """One in-flight sub-request: where its deltas go, and its timing for the histograms."""

    stream: RequestStream
    times: RequestTimes
    last_heard: float = 0.0  # the arrival, then the last delta: the response timeout counts from it


class DeltaInbox:
    """Deltas as they arrive (or the WorkerLost that ends them), taken all at once.

    A list and one waiter rather than an asyncio.Queue: the reader appends every step, the
    handler takes everything at once, so a handler that is behind finds many steps in one go.
    """

    def __init__(self) -> None:
        self._items: list[RequestDelta | WorkerLost] = []
        self._waiter: asyncio.Future | None = None

    def put(self, item: RequestDelta | WorkerLost) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def take(self) -> list[RequestDelta]:
        """Every delta that has arrived, waiting for at least one; raises WorkerLost."""
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        items, self._items = self._items, []
        for item in items:
            if isinstance(item, WorkerLost):
                raise item
        return items


class RequestStream:
    """The deltas of one HTTP request's sub-requests (its prompts times n)."""

    def __init__(self, client: EngineClient, request_ids: list[str]) -> None:
        self._client = client
        self._inbox = DeltaInbox()
        self.open_ids = set(request_ids)

    def put(self, item: RequestDelta | WorkerLost) -> None:
        self._inbox.put(item)

    async def next(self) -> list[RequestDelta]:
        """Every delta that has arrived, waiting for at least one; raises WorkerLost."""
        return await self._inbox.take()

    def finish(self, request_id: str, reason: str) -> None:
        """The gateway ended this sample itself (a stop string): stop it in the worker."""
        if request_id in self.open_ids:
            self._client.abort([request_id], reason)

    def close(self) -> None:
        """Abort whatever is still running (the client went away, or the handler failed)."""
        if self.open_ids:
            self._client.abort(list(self.open_ids), "abort")


class EngineClient:
    """Multiplexes every HTTP request over one worker link."""

    def __init__(self, start_worker: Callable[[], object], *, metrics: EngineMetrics | None = None,
                 max_pending: int | None = 1024, ready_timeout_s: float = 600.0,
                 heartbeat_timeout_s: float | None = None, step_timeout_s: float | None = None,
                 replace_lost_worker: bool = True,
                 response_timeout_s: float | None = DEFAULT_RESPONSE_TIMEOUT_S,
                 on_kv_events: Callable[[KvEvents], None] | None = None,
                 on_request_done: Callable[[str], None] | None = None,
                 on_worker_lost: Callable[[], None] | None = None, log_prefix: str = "") -> None:
        """`on_kv_events`, `on_request_done` (a sub-request id, once its route is gone: finished,
        aborted or failed) and `on_worker_lost`: what a replica set (gateway/replicas/) follows."""
        self._metrics = metrics
        self._on_kv_events = on_kv_events
        self._on_request_done = on_request_done
        self._on_worker_lost = on_worker_lost
        self._response_timeout_s = response_timeout_s  # None: no bound
        self._sweeper: asyncio.Task | None = None
        self._max_pending = max_pending  # None: no bound (the offline API queues in the worker)
        self._routes: dict[str, _Tracked] = {}
        self._pending_aborts: list[str] = []
        self._stats_waiters: list[tuple[asyncio.Future, bool]] = []  # (waiter, wants the check)
        self.last_stats: Stats | None = None
        self.link = WorkerLink(start_worker, on_step=self._on_step, on_lost=self._on_lost,
                               ready_timeout_s=ready_timeout_s, heartbeat_timeout_s=heartbeat_timeout_s,
                               step_timeout_s=step_timeout_s, replace_lost_worker=replace_lost_worker,
                               log_prefix=log_prefix)

    async def start(self) -> Ready:
        ready = await self.link.start()
        if self._response_timeout_s is not None:
            self._sweeper = asyncio.create_task(self._sweep(self._response_timeout_s), name="spillway-request-timeout")
        return ready

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        self._fail_all("the server is shutting down")
        await self.link.close()

    @property
    def ready(self) -> Ready:
        return self.link.ready

    @property
    def healthy(self) -> bool:
        return self.link.state is LinkState.READY

    @property
    def num_in_flight(self) -> int:
        return len(self._routes)

    @property
    def lost_reason(self) -> str | None:
        """Why the last worker was lost, if one was."""
        return self.link.lost_reason

    @property
    def silent_s(self) -> float:
        """Seconds since the worker last said anything (its heartbeats included)."""
        return self.link.silent_s

    def submit(self, generates: list[Generate], num_samples: int = 1, stream=None) -> RequestStream:
        """Send the sub-requests of one HTTP request, `num_samples` (its n) consecutive ones per
        prompt; their deltas arrive on the stream. `stream`: where they go instead of a new
        RequestStream, anything with `put(item)` and an `open_ids` set, which gains their ids (one
        side of a disaggregated request, gateway/replicas/prefill_decode.py)."""
        if not self.healthy:
            raise EngineUnavailable("the engine is not ready: its worker is starting or restarting")
        if self._max_pending is not None and len(self._routes) + len(generates) > self._max_pending:
            raise EngineOverloaded(f"{len(self._routes)} sequences are in flight; the limit is {self._max_pending}")
        if stream is None:
            stream = RequestStream(self, [g.request_id for g in generates])
        else:
            stream.open_ids.update(g.request_id for g in generates)
        now = time.monotonic()
        for generate in generates:
            times = RequestTimes(now, num_token_ids(generate.prompt_token_ids))
            self._routes[generate.request_id] = _Tracked(stream, times, last_heard=now)
            self.link.send(generate)
        if self._metrics is not None:
            for generate in generates[::num_samples]:
                self._metrics.requests.on_params(num_samples, generate.params.max_tokens)
        return stream

    def abort(self, request_ids: Iterable[str], reason: str = "abort") -> None:
        """Stop requests in the worker; aborts made in one loop iteration go out as one message."""
        now = time.monotonic()
        was_empty = not self._pending_aborts
        for request_id in request_ids:
            tracked = self._routes.pop(request_id, None)
            if tracked is None:
                continue
            tracked.stream.open_ids.discard(request_id)
            self._record_finish(tracked, reason, now)
            self._pending_aborts.append(request_id)
            if self._on_request_done is not None:
                self._on_request_done(request_id)
        if self._pending_aborts and was_empty:
            asyncio.get_running_loop().call_soon(self._flush_aborts)

    def _flush_aborts(self) -> None:
        request_ids, self._pending_aborts = self._pending_aborts, []
        if request_ids:
            self.link.send(Abort(request_ids))

    async def refresh_stats(self, timeout_s: float = 1.0) -> Stats | None:
        """Ask the worker for fresh Stats; the last known ones if it does not answer in time."""
        if not self.healthy:
            return self.last_stats
        try:
            return await self.stats(timeout_s)
        except (asyncio.TimeoutError, WorkerLost):
            return self.last_stats

    async def stats(self, timeout_s: float | None = None, check_invariants: bool = False) -> Stats:
        """Fresh Stats from the worker, answered after every message sent before this call;
        `check_invariants`: the worker also walks its block manager (O(blocks)) and the answer
        says whether it held (`invariants_ok`).

        Raises EngineUnavailable, WorkerLost, or TimeoutError after `timeout_s`.
        """
        if not self.healthy:
            raise EngineUnavailable("the engine is not ready: its worker is starting, restarting or gone")
        waiter = asyncio.get_running_loop().create_future()
        self._stats_waiters.append((waiter, check_invariants))
        self._flush_aborts()  # the answer must come after the aborts already made
        self.link.send(Control(ControlCommand.CHECK_INVARIANTS if check_invariants else ControlCommand.STATS))
        return await asyncio.wait_for(waiter, timeout_s)

    def kv_source_lost(self, address: str) -> None:
        """Tell the worker the producer at `address` is gone: its pulls from there fail now."""
        if self.healthy:
            self.link.send(KvSourceLost(address))

    def reset_prefix_cache(self) -> None:
        """Drop the worker's cached prefixes (blocks in use stay); `stats()` after it waits for it."""
        if not self.healthy:
            raise EngineUnavailable("the engine is not ready: its worker is starting, restarting or gone")
        self.link.send(Control(ControlCommand.RESET_PREFIX_CACHE))

    # ---- called by the link -------------------------------------------------------------------

    def _on_step(self, msg: StepOutputs) -> None:
        if msg.kv_events is not None and self._on_kv_events is not None:
            self._on_kv_events(msg.kv_events)
        if msg.stats is not None:
            self.last_stats = msg.stats
            if self._metrics is not None:
                self._metrics.on_stats(msg.stats)
            checked = msg.stats.invariants_ok is not None
            waiting = []
            for waiter, wants_check in self._stats_waiters:
                if wants_check and not checked:
                    waiting.append((waiter, wants_check))  # a routine report: the checked one follows
                elif not waiter.done():
                    waiter.set_result(msg.stats)
            self._stats_waiters = waiting
        now = time.monotonic()
        num_tokens = 0
        gaps: dict[float, int] = {}  # the time of a request's token before -> how many requests
        for delta in msg.outputs:
            tracked = self._routes.get(delta.request_id)
            if tracked is None:
                continue  # aborted by this side; the worker's ABORT delta is expected
            tracked.last_heard = now
            times = tracked.times
            if delta.queued_s >= 0:
                times.queued_s = delta.queued_s
            if delta.new_token_ids:
                num_tokens += len(delta.new_token_ids)
                times.num_generation_tokens += len(delta.new_token_ids)
                if times.last_token is None:
                    self._record_first_token(times, now)
                else:
                    gaps[times.last_token] = gaps.get(times.last_token, 0) + 1
                times.last_token = now
            if delta.finish_reason is not None:
                del self._routes[delta.request_id]
                tracked.stream.open_ids.discard(delta.request_id)
                if self._on_request_done is not None:
                    self._on_request_done(delta.request_id)
                if delta.finish_reason is not FinishReason.ERROR:
                    self._record_finish(tracked, delta.finish_reason.value, now)
            tracked.stream.put(delta)
        if num_tokens and self._metrics is not None:  # once per step, not per request
            self._metrics.generation_tokens.inc(num_tokens)
            requests = self._metrics.requests
            for last_token, count in gaps.items():
                observe_repeated(requests.inter_token_latency, now - last_token, count)
                observe_repeated(requests.time_per_output_token, now - last_token, count)

    def _on_lost(self, reason: str) -> None:
        self._fail_all(reason)
        if self._metrics is not None:
            self._metrics.on_worker_lost()
        if self._on_worker_lost is not None:
            self._on_worker_lost()

    def _fail_all(self, reason: str) -> None:
        routes, self._routes = self._routes, {}
        self._pending_aborts.clear()
        for request_id, tracked in routes.items():
            tracked.stream.open_ids.clear()
            tracked.stream.put(WorkerLost(reason))
            if self._on_request_done is not None:
                self._on_request_done(request_id)
        waiters, self._stats_waiters = self._stats_waiters, []
        for waiter, _ in waiters:
            if not waiter.done():
                waiter.set_exception(WorkerLost(reason))

    async def _sweep(self, timeout_s: float) -> None:
        """End the requests the worker has said nothing about for `timeout_s`."""
        while True:
            await asyncio.sleep(min(timeout_s / 4, 5.0))
            now = time.monotonic()
            late = [rid for rid, tracked in self._routes.items() if now - tracked.last_heard > timeout_s]
            for request_id in late:
                tracked = self._routes.get(request_id)
                if tracked is None:
                    continue
                self.abort([request_id], "abort")
                tracked.stream.put(WorkerTimeout(f"the worker did not answer this request for {timeout_s:g} s"))

    # ---- metrics ------------------------------------------------------------------------------

    def _record_first_token(self, times: RequestTimes, now: float) -> None:
        times.first_token = now
        if self._metrics is not None:
            self._metrics.prompt_tokens.inc(times.num_prompt_tokens)
            self._metrics.requests.time_to_first_token.observe(now - times.arrival)

    def _record_finish(self, tracked: _Tracked, reason: str, now: float) -> None:
        if self._metrics is not None:
            self._metrics.on_finished(reason)
            self._metrics.requests.on_finished(tracked.times, now)
