"""Intake turns: an event-loop iteration runs a bounded share of a burst's intakes (by body
bytes), in order of arrival, so what the loop's sockets wake meanwhile runs between two shares."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import pytest
import uvloop

from spillway.gateway.http.intake_turns import REQUEST_BYTES, STREAM_BYTES, IntakeTurns

LONG = 60_000  # about the JSON of a 10k-id prompt


class Ticker:
    """Counts event-loop iterations: a callback that schedules itself again each time it runs."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.count = 0
        self._loop = loop
        self._handle = loop.call_soon(self._tick)

    def _tick(self) -> None:
        self.count += 1
        self._handle = self._loop.call_soon(self._tick)

    def stop(self) -> None:
        self._handle.cancel()


def run(main, loop_kind: str = "asyncio"):
    return uvloop.run(main()) if loop_kind == "uvloop" else asyncio.run(main())


def burst(turns: IntakeTurns, sizes: list[int], intake_s: float = 0.0):
    """(request index, loop iteration) of each intake of a burst of bodies of `sizes` bytes
    that arrives at once, and the waiters left at the end."""
    async def main():
        ticker, log = Ticker(asyncio.get_running_loop()), []

        async def request(index: int) -> None:
            await turns.take(sizes[index])
            log.append((index, ticker.count))
            time.sleep(intake_s)

        await asyncio.gather(*(request(i) for i in range(len(sizes))))
        ticker.stop()
        return log, turns.waiting
    return main


@pytest.mark.parametrize("loop_kind", ["asyncio", "uvloop"])
def test_long_bodies_go_one_per_iteration_in_order(loop_kind):
    log, waiting = run(burst(IntakeTurns(budget_bytes=64 << 10), [LONG] * 6, 0.001), loop_kind)
    assert [index for index, _ in log] == [0, 1, 2, 3, 4, 5]
    iterations = [tick for _, tick in log]
    assert all(later > earlier for earlier, later in zip(iterations, iterations[1:])), iterations
    assert waiting == 0


@pytest.mark.parametrize("loop_kind", ["asyncio", "uvloop"])
def test_short_bodies_share_an_iteration_up_to_the_budget(loop_kind):
    """100 bodies of 1 KiB (3 KiB counted each) under 64 KiB: 21 an iteration, in order."""
    log, waiting = run(burst(IntakeTurns(budget_bytes=64 << 10), [1024] * 100), loop_kind)
    assert [index for index, _ in log] == list(range(100))
    per_iteration = sorted(Counter(tick for _, tick in log).items())
    assert [count for _, count in per_iteration] == [21, 21, 21, 21, 16]
    assert waiting == 0


def test_the_budget_grows_with_the_streams_the_loop_serves():
    """With 256 streams open a window takes 384 KiB: 128 short requests of 3 KiB counted."""
    streams = [256]
    turns = IntakeTurns(budget_bytes=64 << 10, num_streams=lambda: streams[0])
    assert turns.budget_bytes == 256 * STREAM_BYTES == 384 << 10
    log, _ = run(burst(turns, [1024] * 300))
    assert [count for _, count in sorted(Counter(tick for _, tick in log).items())] == [128, 128, 44]
    streams[0] = 3
    assert turns.budget_bytes == 64 << 10  # never below the floor


def test_a_long_body_among_short_ones_keeps_its_place():
    sizes = [1024] * 3 + [LONG] + [1024] * 3
    log, _ = run(burst(IntakeTurns(budget_bytes=64 << 10), sizes))
    assert [index for index, _ in log] == list(range(7))
    groups = [sorted(i for i, t in log if t == tick) for tick in sorted({t for _, t in log})]
    # 3 x 3 KiB + 60,000 + 2 KiB > 64 KiB: the long one waits, and takes one short one with it.
    assert groups == [[0, 1, 2], [3, 4], [5, 6]]


@pytest.mark.parametrize("loop_kind", ["asyncio", "uvloop"])
def test_a_stream_woken_during_a_burst_runs_before_the_burst_is_in(loop_kind):
    """Ten long intakes of 10 ms arrive at once; the worker's tokens arrive 25 ms in (a timer
    here, a socket in the server). The stream waiting for them writes before the last intake:
    without turns it would wait for all ten (100 ms in one iteration)."""
    async def main():
        turns, events = IntakeTurns(), []
        tokens = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_later(0.025, tokens.set_result, "first tokens")

        async def stream() -> None:
            events.append(await tokens)

        async def request(index: int) -> None:
            await turns.take(LONG)
            time.sleep(0.01)
            events.append(index)

        await asyncio.gather(stream(), *(request(i) for i in range(10)))
        return events

    events = run(main, loop_kind)
    assert [e for e in events if e != "first tokens"] == list(range(10))
    assert events.index("first tokens") <= 5, events  # after ~3 intakes, not after all 10


def test_cancelled_waiters_give_up_their_turns_and_the_rest_go_on():
    async def main():
        turns, done = IntakeTurns(budget_bytes=0), []

        async def request(index: int) -> None:
            await turns.take(LONG)
            done.append(index)

        tasks = [asyncio.create_task(request(i)) for i in range(5)]
        await asyncio.sleep(0)  # all five asked; request 0 has its turn, 1-4 wait
        tasks[2].cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        return done, results, turns.waiting

    done, results, waiting = run(main)
    assert done == [0, 1, 3, 4]
    assert isinstance(results[2], asyncio.CancelledError)
    assert waiting == 0


def test_a_newcomer_after_a_quiet_spell_goes_at_once():
    async def main():
        turns, done = IntakeTurns(budget_bytes=0), []
        for index in range(3):
            await turns.take(LONG)  # nobody waiting: taken at once
            done.append(index)
            await asyncio.sleep(0.001)
        return done

    assert run(main) == [0, 1, 2]
    assert REQUEST_BYTES > 0
