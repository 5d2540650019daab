"""tools/bench/engine/engine.py without a GPU: results written as JSON lines come back as its table,
and a benchmark asked for on a machine without CUDA stops with a message."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(ROOT))

from spillway.tools.bench import result_rows  # noqa: E402
from spillway.tools.bench.result_rows import Rows, row  # noqa: E402


def run_tool(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # no GPU, even on a machine that has one
    return subprocess.run([sys.executable, str(ROOT / "tools" / "bench" / "engine" / "engine.py"), *args],
                          capture_output=True, text=True, timeout=120, env=env)


def test_rows_written_as_json_lines_come_back_as_the_table(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(result_rows, "MACHINE", "a test machine")
    results = tmp_path / "results.jsonl"
    rows = Rows(str(results))
    rows.add(row("decode qwen3-8b batch 1", 4.665, "ms/token", "floor", 3.637, 0.780, target=0.8))
    rows.add(row("throughput qwen3-8b", 9920.8, "output tok/s", target=10_000, target_is_value=True,
                 note="1000 x (1000 in, 1000 out)"))
    assert [r["met"] for r in rows.rows] == [False, False]
    assert all(r["machine"] == "a test machine" for r in rows.rows)
    capsys.readouterr()
    done = run_tool("--report", str(results))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("benchmark")
    assert "decode qwen3-8b batch 1" in lines[1] and lines[1].split()[-1] == "NO"
    assert "9,920.8" in lines[2] and "1000 x (1000 in, 1000 out)" in lines[3]


def test_a_benchmark_without_cuda_stops_with_a_message():
    done = run_tool("--attention")
    assert done.returncode == 1 and "tools/bench/engine/engine.py needs a CUDA GPU" in done.stderr


def test_the_throughput_rows_count_the_matrix_products_of_the_built_in_configs():
    from spillway.tools.bench.engine.engine import matmul_params

    # Qwen3-8B: 8.19B parameters, of which the embedding (151,936 x 4,096) is a lookup.
    layers, head = matmul_params("qwen3-8b")
    embedding = 151_936 * 4_096
    assert head == embedding
    assert abs(layers + head + embedding - 8.19e9) / 8.19e9 < 0.01
    layers_32b, _ = matmul_params("qwen3-32b")  # 64 layers of 5,120: ~31.2B in its layers
    assert abs(layers_32b - 31.2e9) / 31.2e9 < 0.01


def test_decode_timing_waits_for_a_first_token_that_comes_a_call_late(tmp_path, monkeypatch):
    """With asynchronous scheduling the prefill step runs ahead and its token comes back from
    the next call: the timing starts after it, and counts every decoded token."""
    import torch

    from spillway.protocol.config import WorkerConfig
    from spillway.worker.driver.engine import Engine
    from tests.worker.tiny_models import save_tiny_qwen3
    from spillway.tools.bench.engine.engine_runs import decode_ms_per_token

    save_tiny_qwen3(tmp_path)
    engine = Engine(WorkerConfig(model=str(tmp_path), load_format="dummy", dtype="float32", device="cpu",
                                 async_scheduling=True))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    assert decode_ms_per_token(engine, 8, 6, "a") > 0
    assert engine.num_async_steps > 0  # the path that returned no token at the first call


def test_fp8_decode_runs_on_the_cpu_beside_the_unquantized_model(tmp_path):
    """The GPU command `--decode qwen3-8b --quantization fp8`, on a tiny config on the CPU: both
    models' rows against their own floors (FP8's reads fewer bytes), and their ratio."""
    import json

    config = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 512, "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 16, "max_position_embeddings": 8192, "tie_word_embeddings": False, "eos_token_id": 1}
    (tmp_path / "config.json").write_text(json.dumps(config))
    results = tmp_path / "results.jsonl"
    done = run_tool("--decode", str(tmp_path), "--quantization", "fp8", "--device", "cpu", "--prompt-len", "8",
                    "--new-tokens", "4", "--results", str(results))
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {r["name"]: r for r in map(json.loads, results.read_text().splitlines())}
    plain, fp8 = rows[f"decode {tmp_path} batch 1"], rows[f"decode {tmp_path} fp8 batch 1"]
    assert fp8["baseline"] < plain["baseline"]  # the floor: projections a byte a weight, not four
    ratio = rows[f"decode {tmp_path} fp8 batch 1 vs unquantized"]
    assert ratio["baseline"] == plain["value"] and ratio["value"] == fp8["value"]
