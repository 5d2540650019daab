"""`LLM` on the server's client and generation code, against the fake worker (it replays a fixed
token sequence, one token per step): stop strings, min_tokens and the reasoning split as the
server does them, incremental detokenization, interrupts, worker death, and its own thread."""

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
from spillway.gateway import LLM, SamplingParams
from spillway.gateway import llm as llm_module
from spillway.protocol import model_files

REASONING = " The answer is 4. Stop here, then"
ANSWER = " It is 4. Stop. More text follows."
COUNTING = " one, two, three, four, five, six, seven."


@pytest.fixture(scope="module")
def tokenizer():
    return model_files.load_tokenizer(model_files.resolve_model(None))


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.fixture
def fake_llm(monkeypatch):
    """An LLM factory whose worker replays `script`; every LLM made is shut down afterwards."""
    made = []

    def make(script: list[int], *, step_s: float = 0.002, **kwargs) -> LLM:
        monkeypatch.setattr(llm_module, "WorkerProcess",
                            lambda config: FakeWorkerProcess(config, script, step_s=step_s))
        made.append(LLM(device="cpu", max_model_len=256, **kwargs))
        return made[-1]

    yield make
    for llm in made:
        llm.shutdown()


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs)


def test_stop_strings_never_match_inside_the_reasoning(fake_llm, tokenizer):
    think, end = encode(tokenizer, "<think>"), encode(tokenizer, "</think>")
    reasoning, answer = encode(tokenizer, REASONING), encode(tokenizer, ANSWER)
    script = think + reasoning + end + answer
    llm = fake_llm(script, enable_reasoning=True)
    out = llm.generate([[100, 200]], greedy(len(script), stop="Stop"), use_tqdm=False)[0].outputs[0]
    # "Stop" in the reasoning passes; the first one in the answer ends the sample.
    stop_token = next(i for i in range(1, len(answer) + 1) if "Stop" in tokenizer.decode(answer[:i]))
    assert out.finish_reason == "stop" and out.stop_reason == "Stop"
    assert out.token_ids == think + reasoning + end + answer[:stop_token]
    assert out.reasoning_content == REASONING
    assert out.content == " It is 4. "
    assert out.num_reasoning_tokens == len(reasoning)
    assert out.text == "<think>" + REASONING + "</think>" + " It is 4. "


def test_without_a_reasoning_parser_the_same_stop_string_ends_the_thinking(fake_llm, tokenizer):
    script = encode(tokenizer, "<think>") + encode(tokenizer, REASONING)
    llm = fake_llm(script)
    out = llm.generate([[100, 200]], greedy(len(script), stop="Stop"), use_tqdm=False)[0].outputs[0]
    assert out.text == "<think> The answer is 4. "
    assert out.reasoning_content is None and out.content is None


@pytest.mark.parametrize("min_tokens", [0, 1, 3, 4, 6])
def test_min_tokens_lets_early_stop_strings_pass(fake_llm, tokenizer, min_tokens):
    script = encode(tokenizer, COUNTING)
    llm = fake_llm(script)
    out = llm.generate([[100, 200]], greedy(len(script), stop=",", min_tokens=min_tokens),
                       use_tqdm=False)[0].outputs[0]
    # The text of the tokens before the min_tokens-th is never part of a match.
    unchecked = len(tokenizer.decode(script[:max(min_tokens - 1, 0)]))
    cut = COUNTING.index(",", unchecked)
    assert out.text == COUNTING[:cut]
    assert out.finish_reason == "stop" and out.stop_reason == ","
    assert tokenizer.decode(out.token_ids).startswith(COUNTING[:cut + 1])
    assert len(out.token_ids) >= min_tokens


def test_min_tokens_counts_the_thinking(fake_llm, tokenizer):
    think, end = encode(tokenizer, "<think>"), encode(tokenizer, "</think>")
    reasoning, answer = encode(tokenizer, REASONING), encode(tokenizer, ANSWER)
    script = think + reasoning + end + answer
    llm = fake_llm(script, enable_reasoning=True)
    # Reaching min_tokens one token into the answer: the answer's own "Stop" still ends it.
    params = greedy(len(script), stop="Stop", min_tokens=len(think + reasoning + end) + 1)
    out = llm.generate([[100, 200]], params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.content == " It is 4. "
    # Past the answer's "Stop": no more stop strings in the script, the sample runs to its end.
    params = greedy(len(script), stop="Stop", min_tokens=len(script) - 2)
    out = llm.generate([[100, 200]], params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and out.content == ANSWER and out.token_ids == script


def test_detokenization_is_incremental(fake_llm, tokenizer, monkeypatch):
    script = encode(tokenizer, COUNTING * 12)
    llm = fake_llm(script)
    hf = llm.get_tokenizer()
    decoded_ids = []
    original = hf.decode

    def counting_decode(token_ids, *args, **kwargs):
        decoded_ids.append(len(token_ids))
        return original(token_ids, *args, **kwargs)

    monkeypatch.setattr(hf, "decode", counting_decode)
    out = llm.generate([[100, 200]], greedy(len(script), stop="never there"), use_tqdm=False)[0].outputs[0]
    assert out.text == COUNTING * 12 and len(script) > 150
    # A window of a few tokens per step; decoding the whole text each step would be ~n^2 / 2.
    assert max(decoded_ids) <= 8
    assert sum(decoded_ids) <= 8 * len(script)


def test_batches_with_n_logprobs_and_params_per_prompt(fake_llm, tokenizer):
    script = encode(tokenizer, COUNTING)
    llm = fake_llm(script)
    short, long = greedy(3, n=2, logprobs=2), greedy(5)
    outputs = llm.generate([[100], [101, 102], [103]], [short, long, short], use_tqdm=False)
    assert [len(o.outputs) for o in outputs] == [2, 1, 2]
    assert [o.prompt_token_ids for o in outputs] == [[100], [101, 102], [103]]
    assert len({o.request_id for o in outputs}) == 3
    for out in (outputs[0], outputs[2]):
        assert [c.index for c in out.outputs] == [0, 1]
        for completion in out.outputs:
            assert completion.token_ids == script[:3] and completion.finish_reason == "length"
            assert completion.cumulative_logprob == pytest.approx(-1.5)
            assert [sorted(entry) for entry in completion.logprobs] == [sorted({0, 1, t}) for t in script[:3]]
            assert completion.logprobs[0][script[0]].logprob == -0.5
    assert outputs[1].outputs[0].token_ids == script[:5] and outputs[1].outputs[0].logprobs is None
    assert outputs[1].outputs[0].text == tokenizer.decode(script[:5])


def test_chat_renders_the_template_once(fake_llm, tokenizer, monkeypatch):
    llm = fake_llm(encode(tokenizer, COUNTING))
    hf = llm.get_tokenizer()
    renders = []
    original = hf.apply_chat_template

    def counting_render(*args, **kwargs):
        renders.append(kwargs.get("tokenize"))
        return original(*args, **kwargs)

    monkeypatch.setattr(hf, "apply_chat_template", counting_render)
    messages = [{"role": "user", "content": "Count."}]
    out = llm.chat(messages, greedy(4), use_tqdm=False)[0]
    assert renders == [False]
    assert out.prompt == original(messages, tokenize=False, add_generation_prompt=True)
    assert out.prompt_token_ids == encode(tokenizer, out.prompt)


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
    from spillway.gateway import llm as llm_module
    from spillway.gateway.offline import EngineThread

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
    done = subprocess.run([sys.executable, str(script), str(Path(__file__).parent)], capture_output=True, text=True,
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
    from spillway.gateway import offline

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
