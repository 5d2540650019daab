"""`LLM` against the fake worker: interrupts, worker death, shutdown, and its own thread."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from fake_worker import FakeWorkerProcess
from spillway.gateway import LLM
from spillway.gateway.offline import llm as llm_module
from tests.gateway.offline.test_llm_driver import COUNTING, encode, fake_llm, greedy, tokenizer  # noqa: F401 (fixtures)


def interrupt_main_after(seconds: float) -> threading.Timer:
    timer = threading.Timer(seconds, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT))
    timer.start()
    return timer


def test_an_interrupt_aborts_the_batch_in_the_worker(fake_llm, tokenizer):
    script = encode(tokenizer, COUNTING)
    llm = fake_llm(script, step_s=0.05)
    # Ctrl-C as Python delivers it by default, whatever handler an earlier test left behind.
    previous_handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        timer = interrupt_main_after(0.5)
        started = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            outputs = llm.generate([[100], [101], [102]], greedy(200), use_tqdm=False)
            pytest.fail(f"the batch ran to its end in {time.monotonic() - started:.2f} s, "
                        f"{[len(o.outputs[0].token_ids) for o in outputs]} tokens, without the interrupt")
        timer.join()
    finally:
        signal.signal(signal.SIGINT, previous_handler)
    assert time.monotonic() - started < 5  # not after the 10 s the batch would take
    # Without the abort the three requests would run for another 9 s. (Stats sent by the worker
    # on its own, just before it read the abort, may answer the first ask.)
    deadline = time.monotonic() + 2
    while (stats := llm.stats()).num_running and time.monotonic() < deadline:
        time.sleep(0.05)
    assert stats.num_running == 0 and stats.num_free_gpu_blocks == stats.num_gpu_blocks
    again = llm.generate([[100]], greedy(4), use_tqdm=False)[0].outputs[0]
    assert again.token_ids == script[:4]


# A Ctrl-C is raised wherever the main thread is. Here it is raised at every trace event of the
# caller's side of a generate (the wait, its progress bar, the hand-over to the loop): each
# must reach the caller at once, and leave the engine answering; the script then ends through
# the interpreter's exit, where the LLM's finalizer stops the worker. (An interrupt raised just
# after Future.result took its condition's lock used to leave it held: the loop thread blocked
# on it, and the script's exit waited for that loop forever.)
INTERRUPT_SWEEP = textwrap.dedent("""
    import asyncio, gc, sys, time
    sys.path.insert(0, sys.argv[1])
    from fake_worker import FakeWorkerProcess
    from spillway.gateway import LLM, SamplingParams
    from spillway.gateway.offline import llm as llm_module
    from spillway.gateway.offline.engine_thread import EngineThread

    llm_module.WorkerProcess = lambda config: FakeWorkerProcess(config, list(range(100, 140)), step_s=0.001)
    llm = LLM(device="cpu", max_model_len=256)
    params = SamplingParams(max_tokens=3, temperature=0)
    original_call = EngineThread.call
    target, count = None, 0

    def tracer(frame, event, arg):
        global count
        count += 1
        if count == target:
            sys.settrace(None)
            raise KeyboardInterrupt
        return tracer

    def traced_call(*args, **kwargs):
        sys.settrace(tracer)
        try:
            return original_call(*args, **kwargs)
        finally:
            sys.settrace(None)

    EngineThread.call = traced_call
    gc.disable()  # no collection, and so no finalizer, at a random point of the sweep
    llm.generate(["a prompt"], params)  # every event of one uninterrupted call, counted
    events, slowest = count, 0.0
    for target in range(1, events + 1):
        count = 0
        started = time.monotonic()
        try:
            llm.generate(["a prompt"], params)
            sys.exit(f"the interrupt at event {target} of {events} was lost")
        except KeyboardInterrupt:
            slowest = max(slowest, time.monotonic() - started)
        loop = llm._engine._loop
        try:
            asyncio.run_coroutine_threadsafe(asyncio.sleep(0), loop).result(timeout=5)
        except TimeoutError:
            sys.exit(f"after the interrupt at event {target} of {events} the engine's loop does not answer")
    EngineThread.call = original_call
    gc.enable()
    assert llm.generate([[5, 6]], params, use_tqdm=False)[0].outputs[0].token_ids == [100, 101, 102]
    print(f"{events} events, the slowest interrupt took {slowest:.2f} s", flush=True)
""")


def test_an_interrupt_anywhere_in_the_callers_wait_leaves_the_engine_answering(tmp_path):
    script = tmp_path / "sweep.py"
    script.write_text(INTERRUPT_SWEEP)
    started = time.monotonic()
    done = subprocess.run([sys.executable, str(script), str(Path(__file__).parents[1])], capture_output=True, text=True,
                          timeout=240)
    took = time.monotonic() - started
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    events, slowest = done.stdout.split()[0], float(done.stdout.split()[-2])
    assert int(events) > 20 and slowest < 4.0, done.stdout  # each interrupt reached the caller at once
    assert "Traceback" not in done.stderr and "was never awaited" not in done.stderr, done.stderr[-3000:]
    assert took < 120, took


def test_a_dead_worker_raises_runtime_error(fake_llm, tokenizer):
    llm = fake_llm(encode(tokenizer, COUNTING), step_s=0.05)
    pid = llm._engine.client.link.worker_pid
    killer = threading.Timer(0.5, os.kill, (pid, signal.SIGKILL))
    killer.start()
    with pytest.raises(RuntimeError, match="the engine stopped: the worker process was killed by SIGKILL"):
        llm.generate([[100], [101]], greedy(200), use_tqdm=False)
    killer.join()
    with pytest.raises(RuntimeError, match="the engine cannot take requests: the worker process was killed by SIGKILL"):
        llm.generate([[100]], greedy(4), use_tqdm=False)
    with pytest.raises(RuntimeError, match="cannot take requests"):
        llm.stats()


def test_closing_an_engine_whose_loop_does_not_answer_kills_its_worker(fake_llm, tokenizer, monkeypatch, caplog):
    """Every wait of close is bounded: a loop thread blocked for good (as a lock left held would
    block it) gets the worker killed, with a warning naming it, and the caller goes on."""
    from spillway.gateway.offline import engine_thread as offline

    monkeypatch.setattr(offline, "CLOSE_TIMEOUT_S", 1.0)
    monkeypatch.setattr(offline, "CLEANUP_TIMEOUT_S", 0.5)
    llm = fake_llm(encode(tokenizer, COUNTING))
    worker = llm._engine._workers[0].process
    release = threading.Event()
    llm._engine._loop.call_soon_threadsafe(release.wait)
    started = time.monotonic()
    try:
        with caplog.at_level(logging.WARNING, logger="spillway.gateway"):
            llm.shutdown()
        took = time.monotonic() - started
    finally:
        release.set()
        engine = llm._engine  # once released, the loop runs what was left queued and stops
        engine._thread.join(5)
        tasks = asyncio.all_tasks(engine._loop)
        for task in tasks:
            task.cancel()
        engine._loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        engine._loop.close()
    assert took < 5
    worker.join(5)
    assert worker.exitcode == -signal.SIGKILL
    assert f"its worker process (pid {worker.pid}) was killed" in caplog.text


def test_works_inside_a_running_event_loop_and_leaves_no_thread(monkeypatch, tokenizer):
    script = encode(tokenizer, COUNTING)
    monkeypatch.setattr(llm_module, "WorkerProcess", lambda config: FakeWorkerProcess(config, script))
    before = {t.ident for t in threading.enumerate()}

    async def notebook_cell() -> str:
        with LLM(device="cpu", max_model_len=256) as llm:
            return llm.generate([[100]], greedy(6), use_tqdm=False)[0].outputs[0].text

    assert asyncio.run(notebook_cell()) == tokenizer.decode(script[:6])
    leftover = [t.name for t in threading.enumerate() if t.ident not in before and t.is_alive()]
    assert leftover == []


def test_a_shut_down_llm_refuses_work(fake_llm, tokenizer):
    llm = fake_llm(encode(tokenizer, COUNTING))
    llm.shutdown()
    llm.shutdown()  # idempotent
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate([[100]], greedy(4), use_tqdm=False)
