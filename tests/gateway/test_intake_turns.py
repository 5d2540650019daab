"""Intake turns: a burst of requests takes its intakes one per event-loop iteration, in order
of arrival, so what the loop's sockets wake meanwhile runs between two of them."""

from __future__ import annotations

import asyncio
import time

import pytest
import uvloop

from spillway.gateway.intake_turns import IntakeTurns

INTAKE_S = 0.01  # what one long prompt's intake holds the loop for


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


def run(main, loop_kind: str):
    if loop_kind == "uvloop":
        return uvloop.run(main())
    return asyncio.run(main())


@pytest.mark.parametrize("loop_kind", ["asyncio", "uvloop"])
def test_a_burst_takes_one_intake_per_iteration_in_order(loop_kind):
    async def main():
        turns, ticker, log = IntakeTurns(), Ticker(asyncio.get_running_loop()), []

        async def request(index: int) -> None:
            await turns.take()
            log.append((index, ticker.count))
            time.sleep(INTAKE_S / 10)

        await asyncio.gather(*(request(i) for i in range(6)))
        ticker.stop()
        return log, turns.waiting

    log, waiting = run(main, loop_kind)
    assert [index for index, _ in log] == [0, 1, 2, 3, 4, 5]
    iterations = [tick for _, tick in log]
    assert all(later > earlier for earlier, later in zip(iterations, iterations[1:])), iterations
    assert waiting == 0


@pytest.mark.parametrize("loop_kind", ["asyncio", "uvloop"])
def test_a_stream_woken_during_a_burst_runs_before_the_burst_is_in(loop_kind):
    """Ten intakes of 10 ms arrive at once; the worker's tokens arrive 25 ms in (a timer here, a
    socket in the server). The stream waiting for them writes before the last intake: without
    turns it would wait for all ten (100 ms in one iteration)."""
    async def main():
        turns, events = IntakeTurns(), []
        tokens = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_later(0.025, tokens.set_result, "first tokens")

        async def stream() -> None:
            events.append(await tokens)

        async def request(index: int) -> None:
            await turns.take()
            time.sleep(INTAKE_S)
            events.append(index)

        await asyncio.gather(stream(), *(request(i) for i in range(10)))
        return events

    events = run(main, loop_kind)
    assert [e for e in events if e != "first tokens"] == list(range(10))
    assert events.index("first tokens") <= 5, events  # after ~3 intakes, not after all 10


def test_a_cancelled_waiter_gives_up_its_turn_and_the_rest_go_on():
    async def main():
        turns, done = IntakeTurns(), []

        async def request(index: int) -> None:
            await turns.take()
            done.append(index)

        tasks = [asyncio.create_task(request(i)) for i in range(4)]
        await asyncio.sleep(0)  # all four asked; request 0 has its turn, 1-3 wait
        tasks[2].cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        return done, results, turns.waiting

    done, results, waiting = asyncio.run(main())
    assert done == [0, 1, 3]
    assert isinstance(results[2], asyncio.CancelledError)
    assert waiting == 0


def test_turns_start_again_after_a_quiet_spell():
    async def main():
        turns, done = IntakeTurns(), []
        for index in range(3):
            await turns.take()  # nobody waiting: taken at once
            done.append(index)
            await asyncio.sleep(0.001)
        return done

    assert asyncio.run(main()) == [0, 1, 2]
