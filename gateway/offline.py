"""The offline API's engine: the server's EngineClient and Generation, on an event loop of its own.

    LLM.generate (the caller's thread)                       loop thread (daemon, owned by LLM)
        call(run_generations, ...) ──────────────────────▶  Generation.start / updates()
        blocks on the result        ◀── samples, logprobs ──  EngineClient ── WorkerLink ── worker

The loop lives in its own thread, so `LLM` works the same from a plain script and from code
that already runs an event loop (a notebook). If the caller's wait is interrupted (Ctrl-C), the
batch's coroutine is cancelled and its cleanup aborts the batch's requests in the worker before
the interrupt reaches the caller. `close()` stops the worker, the loop and its threads.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine

from spillway.gateway.client import EngineClient
from spillway.gateway.serving import Generation
from spillway.protocol.messages import Ready, TokenLogprobs

CLEANUP_TIMEOUT_S = 5.0


class EngineThread:
    """An EngineClient running on a private event loop in a daemon thread; blocking calls into it."""

    def __init__(self, start_worker: Callable[[], object], ready_timeout_s: float = 600.0) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="spillway-offline-loop", daemon=True)
        self._thread.start()
        self.client: EngineClient | None = None
        self._start_worker = start_worker
        self._ready_timeout_s = ready_timeout_s

    def start(self) -> Ready:
        """Start the worker and wait until it is ready; raises what starting it raised."""
        return self.call(self._start)

    async def _start(self) -> Ready:
        # The worker is never replaced: a lost worker fails this LLM, as a crashed engine should.
        # No response bound: every prompt of a batch is queued in the worker at once, and the
        # last may rightly wait for hours; a local worker's death ends them all at once anyway.
        self.client = EngineClient(self._start_worker, max_pending=None, ready_timeout_s=self._ready_timeout_s,
                                   replace_lost_worker=False, response_timeout_s=None)
        return await self.client.start()

    def call(self, function: Callable[..., Coroutine], *args):
        """Run `function(*args)` on the loop and wait for its result.

        Any exception in the waiting thread (KeyboardInterrupt) cancels the coroutine and waits
        for its cleanup before it is raised.
        """
        finished = threading.Event()

        async def tracked():
            try:
                return await function(*args)
            finally:
                finished.set()

        future = asyncio.run_coroutine_threadsafe(tracked(), self._loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()
            finished.wait(CLEANUP_TIMEOUT_S)
            raise

    def close(self) -> None:
        """Stop the worker and the loop; idempotent."""
        if self._loop.is_closed():
            return
        if threading.current_thread() is self._thread:  # a finalizer run by the loop itself
            self._loop.call_soon(lambda: asyncio.ensure_future(self._close_client()))
            return
        if self._thread.is_alive():
            try:
                self.call(self._close_client)
                self.call(self._loop.shutdown_default_executor)
            finally:
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join()
        self._loop.close()

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
