"""SPILLWAY_STEP_TRACE: one JSON line per engine step with the step's plan and first tokens."""

from __future__ import annotations

import json
import time

from spillway.protocol.config import WorkerConfig
from spillway.protocol.messages import Generate, SamplingParams
from spillway.worker.driver.engine import Engine
from spillway.worker.step_trace import StepTrace

from tiny_models import save_tiny_qwen3


def test_each_step_writes_its_plan_and_first_tokens(tmp_path):
    save_tiny_qwen3(tmp_path / "model")
    engine = Engine(WorkerConfig(model=str(tmp_path / "model"), device="cpu", dtype="float32", max_num_seqs=4,
                                 num_gpu_blocks_override=64))
    trace = StepTrace(str(tmp_path / "trace.jsonl"))
    for name, prompt in (("a", [5, 6, 7]), ("b", list(range(10, 30)))):
        engine.add_request(Generate(request_id=name, prompt_token_ids=prompt, block_hashes=[],
                                    params=SamplingParams(max_tokens=2, temperature=0.0)))
    while engine.has_work:
        started = time.perf_counter()
        deltas = engine.step()
        trace.record(started, time.perf_counter(), 0, engine, deltas)
    lines = [json.loads(line) for line in (tmp_path / "trace.jsonl").read_text().splitlines()]
    assert lines[0]["t"] == 0.0 and lines[0]["chunks"] == 2 and lines[0]["tokens"] == 23
    assert sum(line["firsts"] for line in lines) == 2  # each request's first token, once
    assert sum(line["deltas"] for line in lines) == 4  # 2 tokens each
    assert all(line["step_ms"] > 0 and line["to_gpu_mb"] == 0.0 for line in lines)
    assert [line["t"] for line in lines] == sorted(line["t"] for line in lines)
