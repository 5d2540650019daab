"""tools/bench/engine/spec.py on the CPU over a tiny random Qwen3: every section end to end (replayed
outputs, a draft cut from the target, batches with n-gram and replay), its rows as JSON
lines, the truncated draft checkpoint, and its flag errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

ROOT = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(ROOT))

from spillway.protocol.messages import Generate, SamplingParams  # noqa: E402
from spillway.worker.runner.device_settings import WorkerConfig  # noqa: E402
from spillway.worker.driver.engine import Engine  # noqa: E402
from tests.worker.tiny_models import save_tiny_qwen3  # noqa: E402
from spillway.tools.bench.engine.spec_runs import damp_layers_after, write_truncated_copy  # noqa: E402


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return save_tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3-bench-spec"))


def run_tool(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # no GPU, even on a machine that has one
    return subprocess.run([sys.executable, str(ROOT / "tools" / "bench" / "engine" / "spec.py"), *args],
                          capture_output=True, text=True, timeout=600, env=env)


def test_every_section_runs_end_to_end_on_the_cpu(tiny_model, tmp_path):
    results = tmp_path / "results.jsonl"
    done = run_tool("--device", "cpu", "--model", tiny_model, "--async-scheduling", "--k", "1,2",
                    "--num-prompts", "1", "--prompt-len", "12", "--new-tokens", "16", "--draft-layers", "2",
                    "--draft-k", "2", "--batches", "3", "--input-len", "12", "--output-len", "10",
                    "--repeats", "2", "--results", str(results))
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {r["name"]: r for r in map(json.loads, results.read_text().splitlines())}
    model = Path(tiny_model).name
    decode, throughput = f"decode {model} batch 1", f"throughput {model} batch 3"
    assert list(rows) == [
        f"{decode} no speculation", f"{decode} replay k=1", f"{decode} replay k=2",
        f"{decode} draft 2/2 layers k=2, switch as built", f"{decode} draft 2/2 layers k=2, switch always on",
        f"{throughput} no speculation", f"{throughput} ngram k=4", f"{throughput} replay k=4"]
    # Replayed outputs and a draft that is the whole target: every draft accepted, outputs unchanged.
    whole_draft = f"{decode} draft 2/2 layers k=2, switch always on"
    for name in (f"{decode} replay k=2", whole_draft, f"{throughput} replay k=4"):
        counts = rows[name]["counts"]
        assert counts["accepted_tokens"] == counts["draft_tokens"] > 0, name
        assert counts["tokens_as_plain"] == counts["tokens"], name
    # 16 tokens: the prefill's, then k + 1 = 3 per step; speculation asked for on every step
    # (with asynchronous scheduling too) and drafted on each but the prefill.
    counts = rows[f"{decode} replay k=2"]["counts"]
    assert (counts["plain_steps"], counts["steps"], counts["switch_on"], counts["switch_off"],
            counts["drafted_steps"], counts["verified"]) == (16, 6, 6, 0, 5, 5)
    # 3 requests of 10 tokens at once, 4 drafts each: a prefill step, then 9 tokens in two steps.
    counts = rows[f"{throughput} replay k=4"]["counts"]
    assert (counts["plain_steps"], counts["steps"], counts["tokens"]) == (10, 3, 30)
    for name in (f"{throughput} ngram k=4", f"{throughput} replay k=4"):
        row = rows[name]
        assert row["target"] == 0.97 and row["ratio"] == pytest.approx(row["value"] / row["baseline"])
        assert row["baseline"] == rows[f"{throughput} no speculation"]["value"]
    assert "acceptance 1.000" in rows[f"{decode} replay k=1"]["note"]
    assert "median of 2" in rows[f"{throughput} ngram k=4"]["note"]
    assert all(r["machine"].startswith("CPU") for r in rows.values())
    report = run_tool("--report", str(results))
    assert report.returncode == 0 and report.stdout.count(" no speculation ") >= 2


def test_a_truncated_copy_holds_the_first_layers_and_decodes_like_the_target_when_whole(tiny_model, tmp_path):
    """A dummy target is rebuilt from its seed: its whole copy decodes exactly as it does."""
    target = Engine(WorkerConfig(model=tiny_model, load_format="dummy", dtype="float32", device="cpu", seed=3))
    write_truncated_copy(target, 1, tmp_path / "one")
    with safe_open(str(tmp_path / "one" / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert {name.split(".")[2] for name in names if name.startswith("model.layers.")} == {"0"}
    assert {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"} <= names
    assert json.loads((tmp_path / "one" / "config.json").read_text())["num_hidden_layers"] == 1
    write_truncated_copy(target, 2, tmp_path / "whole")
    copy = Engine(WorkerConfig(model=str(tmp_path / "whole"), dtype="float32", device="cpu"))
    assert greedy_tokens(copy) == greedy_tokens(target)


def test_a_damped_target_is_foretold_by_its_cut_draft(tiny_model, tmp_path):
    """Past the draft's layers, a damped target only nudges the stream: the one-layer cut decodes
    as the damped target does, while undamped the two part ways."""
    target = Engine(WorkerConfig(model=tiny_model, load_format="dummy", dtype="float32", device="cpu", seed=3))
    write_truncated_copy(target, 1, tmp_path / "one")
    draft = Engine(WorkerConfig(model=str(tmp_path / "one"), dtype="float32", device="cpu"))
    first_layer = [p.clone() for p in target.runner.model.model.layers[0].parameters()]
    assert greedy_tokens(draft) != greedy_tokens(target)
    damp_layers_after(target, 1, 1e-4)
    assert greedy_tokens(draft) == greedy_tokens(target)
    assert all(torch.equal(a, b) for a, b in zip(first_layer, target.runner.model.model.layers[0].parameters()))


def greedy_tokens(engine: Engine) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    engine.add_request(Generate(request_id="a", prompt_token_ids=list(range(20, 36)), block_hashes=[], params=params))
    tokens = []
    while engine.has_work:
        tokens += [token for delta in engine.step() for token in delta.new_token_ids]
    return tokens


@pytest.mark.parametrize("flags, message", [
    (["--k", "0"], "argument --k: expected comma-separated positive integers, got '0'"),
    (["--batches", "32,x"], "argument --batches: expected comma-separated positive integers"),
    (["--model", "no-such-model"], "--model: 'no-such-model' is neither a built-in config"),
    (["--draft-layers", "3"], "--draft-layers: 3 is more than"),
    (["--new-tokens", "10", "--k", "8"], "--new-tokens: at least twice the largest k + 1"),
    (["--draft-damp", "0"], "--draft-damp: a factor in (0, 1], got 0.0"),
])
def test_bad_flags_exit_2_naming_the_flag(tiny_model, flags, message):
    model = [] if "--model" in flags else ["--model", tiny_model]
    done = run_tool("--device", "cpu", *model, *flags)
    assert done.returncode == 2 and message in done.stderr, done.stderr


def test_without_cuda_it_stops_with_a_message(tiny_model):
    done = run_tool("--model", tiny_model, "--decode")
    assert done.returncode == 1 and "tools/bench/engine/spec.py needs a CUDA GPU (or --device cpu)" in done.stderr


def test_a_row_keeps_the_run_of_median_time():
    from spillway.tools.bench.engine.spec import median_run
    from spillway.tools.bench.engine.spec_runs import Run

    runs = [(Run(seconds=seconds), tag) for seconds, tag in ((3.0, "c"), (1.0, "a"), (2.0, "b"))]
    assert median_run(runs)[1] == "b"
    assert median_run(runs[:2])[1] == "c"  # an even count: the upper one
