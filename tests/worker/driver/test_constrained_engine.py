"""Constrained requests in the engine (worker/driver/constrained.py): a grammar compiles off the
busy loop while other requests keep stepping; an abort while it compiles leaves nothing behind;
a compile past its time bound, or a model folder without a tokenizer, is an error naming why."""

from __future__ import annotations

from concurrent.futures import Future

import pytest
from tiny_models import save_tiny_qwen3

from spillway.protocol.config import WorkerConfig
from spillway.protocol.local import model_files
from spillway.protocol.messages import FinishReason, Generate, SamplingParams, StructuredKind, StructuredOutput
from spillway.worker.driver.engine import Engine

CHOICE = StructuredOutput(kind=StructuredKind.CHOICE, spec='["yes", "no"]')


def generate(request_id: str, structured: StructuredOutput | None = None) -> Generate:
    return Generate(request_id=request_id, prompt_token_ids=[5, 6, 7, 8], block_hashes=[],
                    params=SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, structured=structured))


@pytest.fixture(scope="module")
def engine():
    engine = Engine(WorkerConfig(model=str(model_files.resolve_model(None).path), device="cpu", dtype="float32",
                                 max_num_seqs=4, max_model_len=256))
    engine.debug_invariants = True
    yield engine
    engine.close()


def run(engine: Engine, limit: int = 50) -> dict[str, list]:
    deltas: dict[str, list] = {}
    for _ in range(limit):
        if not engine.has_work:
            break
        for delta in engine.step():
            deltas.setdefault(delta.request_id, []).append(delta)
    assert not engine.has_work
    return deltas


def test_a_slow_compile_holds_only_its_request(engine, monkeypatch):
    pending: Future = Future()
    real_submit = engine.constrained.compiler.submit
    monkeypatch.setattr(engine.constrained.compiler, "submit", lambda structured: pending)
    assert engine.add_request(generate("slow", CHOICE)) is None
    assert engine.add_request(generate("free")) is None
    free = []
    for _ in range(20):  # the free request runs to its end while the grammar compiles
        free += [delta for delta in engine.step() if delta.request_id == "free"]
        if free and free[-1].finish_reason is not None:
            break
    assert free[-1].finish_reason is FinishReason.LENGTH
    assert sum(len(delta.new_token_ids) for delta in free) == 4
    assert engine.constrained.num_compiling == 1 and engine.has_work
    pending.set_result(real_submit(CHOICE).result())
    deltas = run(engine)
    tokens = [token for delta in deltas["slow"] for token in delta.new_token_ids]
    assert deltas["slow"][-1].finish_reason is FinishReason.STOP and 1 <= len(tokens) <= 3


def test_an_abort_while_compiling_leaves_nothing(engine, monkeypatch):
    monkeypatch.setattr(engine.constrained.compiler, "submit", lambda structured: Future())
    assert engine.add_request(generate("gone", CHOICE)) is None
    assert [(d.request_id, d.finish_reason) for d in engine.abort(["gone"])] == [("gone", FinishReason.ABORT)]
    assert engine.constrained.num_compiling == 0 and not engine.has_work


def test_a_compile_past_its_time_bound_is_refused(engine, monkeypatch):
    monkeypatch.setattr(engine.constrained.compiler, "submit", lambda structured: Future())
    monkeypatch.setattr(engine.constrained, "compile_timeout_s", 0.0)
    assert engine.add_request(generate("late", CHOICE)) is None
    deltas = run(engine)
    (delta,) = deltas["late"]
    assert delta.finish_reason is FinishReason.ERROR
    assert delta.error == "the choice constraint took longer than 0 s to compile"


def test_a_model_without_a_tokenizer_says_so(tmp_path):
    engine = Engine(WorkerConfig(model=save_tiny_qwen3(tmp_path), device="cpu", dtype="float32", max_num_seqs=2,
                                 max_model_len=128))
    try:
        assert engine.add_request(generate("r", CHOICE)) is None
        (delta,) = run(engine)["r"]
    finally:
        engine.close()
    assert delta.finish_reason is FinishReason.ERROR
    assert delta.error.startswith("structured outputs need the model's tokenizer")


def test_the_compile_bound_comes_from_the_environment(monkeypatch):
    from spillway.gateway.link.engine_args import engine_config

    monkeypatch.delenv("SPILLWAY_GRAMMAR_COMPILE_TIMEOUT_S", raising=False)
    assert engine_config(None)[0].grammar_compile_timeout_s == 20.0
    monkeypatch.setenv("SPILLWAY_GRAMMAR_COMPILE_TIMEOUT_S", "2.5")
    assert engine_config(None)[0].grammar_compile_timeout_s == 2.5
    for value, message in (("soon", "'soon' is not a number of seconds"), ("0", "must be > 0 s")):
        monkeypatch.setenv("SPILLWAY_GRAMMAR_COMPILE_TIMEOUT_S", value)
        with pytest.raises(ValueError, match=message):
            engine_config(None)
