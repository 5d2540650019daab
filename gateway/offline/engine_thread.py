"""The offline API's engine: the server's EngineClient and Generation, on an event loop of its own.

    LLM.generate (the caller's thread)                       loop thread (daemon, owned by LLM)
        call(run_generations, ...) ──────────────────────▶  Generation.start / updates()
        blocks on the result        ◀── samples, logprobs ──  EngineClient ── WorkerLink ── worker

The loop lives in its own thread, so `LLM` works the same from a plain script and from code
that already runs an event loop (a notebook). If the caller's wait is interrupted (Ctrl-C), the
batch's coroutine is cancelled and its cleanup aborts the batch's requests in the worker before
the interrupt reaches the caller. `close()` stops the worker, the loop and its threads, each wait
bounded: a loop that does not answer gets its worker killed, with a warning, and the caller goes on.

The caller and the loop thread share no lock the caller ever takes and the loop thread waits for:
a KeyboardInterrupt is raised wherever the caller's thread happens to be, and one raised just
after a lock was taken (inside a Python-level `__enter__`, as `concurrent.futures.Future.result`
and `threading.Event.wait` take their condition's lock) leaves that lock held for good. The loop
thread only ever releases the caller's lock (`_Call.done`), and the progress bar is updated by
the caller's thread alone.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections.abc import Callable, Coroutine

from spillway.gateway.link.client import EngineClient
from spillway.gateway.replicas.prefill_decode import PrefillDecodeSet
from spillway.gateway.replicas.replica_set import ReplicaSet
from spillway.gateway.generation.serving import Generation
from spillway.protocol.messages import Ready, TokenLogprobs

logger = logging.getLogger("spillway.gateway")

CLEANUP_TIMEOUT_S = 5.0  # an interrupted call's cleanup (aborting its requests) before the interrupt is raised
# Stopping the worker takes at most 10 s (WorkerProcess.close: SHUTDOWN, then SIGTERM, 5 s each).
CLOSE_TIMEOUT_S = 20.0
POLL_S = 0.1  # how often a waiting caller runs its `on_wait`


class _Call:
    """One coroutine run on the loop for a caller in another thread.

    The caller holds `done` from the start and waits to acquire it again; the loop thread
    releases it once the task has ended (or, cancelled before it was made, never will start).
    `finished` is set before that release."""

    def __init__(self, loop: asyncio.AbstractEventLoop, function: Callable[..., Coroutine], args: tuple) -> None:
        self._loop = loop
        self._function = function
        self._args = args
        self.done = threading.Lock()
        self.done.acquire()
        self.finished = False
        self._task: asyncio.Task | None = None
        self._result = None
        self._exception: BaseException | None = None

    def start(self) -> None:  # on the loop
        self._task = self._loop.create_task(self._function(*self._args))
        self._task.add_done_callback(self._end)

    def cancel(self) -> None:  # on the loop, always after `start` if that was scheduled at all
        if self.finished:
            return
        if self._task is None:  # never started: nothing to wait for
            self._finish()
        else:
            self._task.cancel()

    def _end(self, task: asyncio.Task) -> None:
        # The task dies on the loop thread: freed in the caller's, its weak-set entry's removal
        # would run there, and an interrupt raised inside that callback would be lost.
        self._task = None
        if task.cancelled():
            self._exception = asyncio.CancelledError()
        else:
            self._exception = task.exception()
            self._result = None if self._exception is not None else task.result()
        self._finish()

    def _finish(self) -> None:
        self.finished = True
        self.done.release()

    def outcome(self):
        if self._exception is not None:
            raise self._exception
        return self._result


class EngineThread:
    """An EngineClient running on a private event loop in a daemon thread; blocking calls into it."""

    def __init__(self, start_worker: Callable[[], object] | list[Callable[[], object]], ready_timeout_s: float = 600.0,
                 *, routing: str = "prefix", max_num_seqs: int = 256, sequential_start: bool = False,
                 prefill_workers: int = 0) -> None:
        """`start_worker`: one worker, or a list, one per data-parallel replica (gateway/replicas/),
        routed by `routing` and started one after another with `sequential_start`; with
        `prefill_workers`, that many producers first, then the consumers (disaggregated prefill
        and decode, gateway/replicas/prefill_decode.py)."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="spillway-offline-loop", daemon=True)
        self._thread.start()
        self.client: EngineClient | ReplicaSet | PrefillDecodeSet | None = None
        self._start_workers = start_worker if isinstance(start_worker, list) else [start_worker]
        self._ready_timeout_s = ready_timeout_s
        self._routing, self._max_num_seqs, self._sequential_start = routing, max_num_seqs, sequential_start
        self._prefill_workers = prefill_workers
        self._workers: list[object] = []  # every worker handle started, for close's last resort
        self._closing = False

    def start(self) -> Ready:
        """Start the worker and wait until it is ready; raises what starting it raised."""
        return self.call(self._start)

    async def _start(self) -> Ready:
        # The worker is never replaced: a lost worker fails this LLM, as a crashed engine should.
        # No response bound: every prompt of a batch is queued in the worker at once, and the
        # last may rightly wait for hours; a local worker's death ends them all at once anyway.
        options = dict(max_pending=None, ready_timeout_s=self._ready_timeout_s, replace_lost_worker=False,
                       response_timeout_s=None)
        starts = [functools.partial(self._recorded_worker, start) for start in self._start_workers]
        split = self._prefill_workers
        if split:
            self.client = PrefillDecodeSet(starts[:split], starts[split:], routing=self._routing,
                                           max_num_seqs=self._max_num_seqs, sequential_start=self._sequential_start,
                                           **options)
        elif len(starts) == 1:
            self.client = EngineClient(starts[0], **options)
        else:
            self.client = ReplicaSet(starts, routing=self._routing, max_num_seqs=self._max_num_seqs,
                                     sequential_start=self._sequential_start, **options)
        return await self.client.start()

    def _recorded_worker(self, start_worker: Callable[[], object]):
        handle = start_worker()
        self._workers.append(handle)
        return handle

    def call(self, function: Callable[..., Coroutine], *args, on_wait: Callable[[], None] | None = None,
             timeout_s: float | None = None):
        """Run `function(*args)` on the loop and wait for its result, calling `on_wait` in this
        thread every POLL_S meanwhile; TimeoutError after `timeout_s`.

        Any exception in the waiting thread (KeyboardInterrupt) cancels the coroutine and waits
        (CLEANUP_TIMEOUT_S at most) for its cleanup before it is raised.
        """
        run = _Call(self._loop, function, args)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        try:
            self._loop.call_soon_threadsafe(run.start)
            while not run.done.acquire(timeout=POLL_S):
                if on_wait is not None:
                    on_wait()
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"{getattr(function, '__name__', function)} did not end within {timeout_s:.0f} s")
        except BaseException:
            if not run.finished:
                try:
                    self._loop.call_soon_threadsafe(run.cancel)
                except RuntimeError:  # the loop is closed: nothing runs there any more
                    pass
                else:
                    run.done.acquire(timeout=CLEANUP_TIMEOUT_S)
            raise
        return run.outcome()

    def close(self) -> None:
        """Stop the worker and the loop; idempotent. Every wait is bounded: if the loop does not
        answer, the worker is killed and the loop's daemon thread left behind, with a warning."""
        if self._loop.is_closed() or self._closing:
            return
        if threading.current_thread() is self._thread:  # a finalizer run by the loop itself
            self._loop.call_soon(lambda: asyncio.ensure_future(self._close_client()))
            return
        self._closing = True
        if self._thread.is_alive():
            stuck = False
            try:
                self.call(self._close_client, timeout_s=CLOSE_TIMEOUT_S)
                self.call(self._loop.shutdown_default_executor, timeout_s=CLOSE_TIMEOUT_S)
            except TimeoutError as exc:
                stuck = True
                self._kill_workers(f"the offline engine did not stop ({exc})")
            finally:
                try:
                    self._loop.call_soon_threadsafe(self._loop.stop)
                except RuntimeError:
                    pass
                self._thread.join(1.0 if stuck else CLOSE_TIMEOUT_S)
            if self._thread.is_alive():
                logger.warning("the offline engine's event loop did not stop; its daemon thread is left behind")
                if not stuck:
                    self._kill_workers("the offline engine's event loop did not stop")
                return
        self._workers.clear()
        self._loop.close()

    def _kill_workers(self, reason: str) -> None:
        for handle in self._workers:
            process = getattr(handle, "process", None)
            if process is not None and process.is_alive():
                process.kill()
                logger.warning("%s; its worker process (pid %d) was killed", reason, process.pid)

    async def _close_client(self) -> None:
        if self.client is not None:
            await self.client.close()


async def run_generations(generations: list[Generation], on_prompt_done: Callable[[], None]
                          ) -> list[list[list[TokenLogprobs]]]:
    """Start every generation and consume them all; each sample's logprobs, per generation.

    On any failure or cancellation, the samples still running are aborted in the worker.
    """
    tasks: list[asyncio.Task] = []
    try:
        for generation in generations:
            generation.start()
        logprobs = [[[] for _ in generation.samples] for generation in generations]
        tasks = [asyncio.create_task(_consume(generation, entries, on_prompt_done))
                 for generation, entries in zip(generations, logprobs)]
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in done:
            if task.exception() is not None:
                raise task.exception()
        return logprobs
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for generation in generations:
            generation.close()


async def _consume(generation: Generation, logprobs: list[list[TokenLogprobs]],
                   on_prompt_done: Callable[[], None]) -> None:
    num_open = [generation.job.params.n] * len(generation.job.prompts)
    async for updates in generation.updates():
        for update in updates:
            sample = update.sample
            if update.logprobs:
                logprobs[sample.index].extend(update.logprobs)
            if update.finished:
                num_open[sample.prompt_index] -= 1
                if num_open[sample.prompt_index] == 0:
                    on_prompt_done()
