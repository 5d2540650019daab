"""Constrained requests in steps that run ahead (worker/driver/engine.py: the forward launched,
the step before committed, then the masks filled and the sampling launched): the default model
on the CPU gives the same tokens and finish reasons with asynchronous scheduling on and off, for
a JSON schema, a choice and a regex, greedy and seeded, beside free requests; and with only
constrained requests running, steps do run ahead."""

from __future__ import annotations

import json

import pytest

from spillway.protocol.config import WorkerConfig
from spillway.protocol.local import model_files
from spillway.protocol.messages import Generate, SamplingParams, StructuredKind, StructuredOutput
from spillway.worker.driver.engine import Engine

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                                    "maxItems": 4}},
          "required": ["name", "tags"]}
CONSTRAINTS = {
    "json": StructuredOutput(kind=StructuredKind.JSON, spec=json.dumps(SCHEMA)),
    "choice": StructuredOutput(kind=StructuredKind.CHOICE, spec='["alpha", "beta", "gamma delta"]'),
    "regex": StructuredOutput(kind=StructuredKind.REGEX, spec=r"[a-z]{3,8}( [0-9]{1,3}){2,4}"),
}


def requests(free: bool) -> list[Generate]:
    made = []
    for k, (name, structured) in enumerate(CONSTRAINTS.items()):
        for sampled in (False, True):
            params = SamplingParams(max_tokens=40, temperature=0.9 if sampled else 0.0, seed=11 + k if sampled else None,
                                    structured=structured)
            made.append(Generate(request_id=f"{name}-{sampled}", prompt_token_ids=list(range(20 + k, 40 + k)),
                                 block_hashes=[], params=params))
    if free:
        made.append(Generate(request_id="free", prompt_token_ids=list(range(50, 70)), block_hashes=[],
                             params=SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)))
    return made


def run(async_scheduling: bool, free: bool) -> tuple[dict, int]:
    engine = Engine(WorkerConfig(model=str(model_files.resolve_model(None).path), device="cpu", dtype="float32",
                                 max_num_seqs=8, max_model_len=256, async_scheduling=async_scheduling))
    try:
        engine.debug_invariants = True
        for generate in requests(free):
            assert engine.add_request(generate) is None
        tokens: dict[str, list[int]] = {}
        reasons: dict[str, str] = {}
        for _ in range(400):
            if not engine.has_work:
                break
            for delta in engine.step():
                tokens.setdefault(delta.request_id, []).extend(delta.new_token_ids)
                if delta.finish_reason is not None:
                    reasons[delta.request_id] = delta.finish_reason.value
        assert not engine.has_work
        return {rid: (tokens[rid], reasons[rid]) for rid in tokens}, engine.num_async_steps
    finally:
        engine.close()


@pytest.mark.parametrize("free", [True, False], ids=["with a free request", "constrained only"])
def test_constrained_steps_run_ahead_and_give_the_same_tokens(free):
    sync, sync_steps = run(False, free)
    ahead, async_steps = run(True, free)
    assert ahead == sync
    assert sync_steps == 0 and async_steps > 10
    assert all(reason in ("stop", "length") for _, reason in sync.values())
    assert any(reason == "stop" for _, reason in sync.values())  # some grammars closed their answer
