"""tools/bench/kernels/tune_moe.py: its search space, and the whole tool on a tiny shape through
Triton's interpreter (--dry-run), writing a table the kernel's config reader takes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from spillway.kernels.moe_config import MoeConfig, nearest_bucket, read_buckets

ROOT = Path(__file__).resolve().parents[4]

from spillway.tools.bench.kernels import tune_moe  # noqa: E402
from spillway.tools.bench.kernels.moe_cases import SHAPES  # noqa: E402


def test_the_dry_run_writes_a_table_the_reader_takes(tmp_path):
    out = tmp_path / "table.json"
    tool = str(ROOT / "tools/bench/kernels/tune_moe.py")
    done = subprocess.run([sys.executable, tool, "--dry-run", "--out", str(out)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 0, done.stderr[-3000:]
    table = json.loads(out.read_text())
    assert table["shape"] == dict(experts=4, hidden=48, intermediate=40, topk=2, dtype="fp32", device="cpu")
    buckets = read_buckets(out)
    assert sorted(buckets) == [1, 5]
    assert all(isinstance(config, MoeConfig) for config in buckets.values())
    assert nearest_bucket(buckets, 3) == 5
    rows = [line.split() for line in done.stdout.splitlines() if line.split()[:1] in (["1"], ["5"])]
    assert [row[0] for row in rows] == ["1", "5"]
    assert "wrong" not in done.stdout and "skipped" not in done.stdout  # every candidate ran and matched


def test_the_dry_run_of_fp8_weights_writes_a_table_of_fp8_weights(tmp_path):
    """The table's shape says its weights are fp8; each candidate ran and matched the fp8 experts."""
    tool = str(ROOT / "tools/bench/kernels/tune_moe.py")
    done = subprocess.run([sys.executable, tool, "--dry-run", "--fp8-weights", "--batches", "1", "--out",
                           str(tmp_path / "table.json")], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 0, done.stderr[-3000:]
    shape = json.loads((tmp_path / "table.json").read_text())["shape"]
    assert shape == dict(experts=4, hidden=48, intermediate=40, topk=2, dtype="fp32", device="cpu", weights="fp8")
    assert "fp8 weights" in done.stdout.splitlines()[0]
    assert "wrong" not in done.stdout and "skipped" not in done.stdout
    assert sorted(read_buckets(tmp_path / "table.json")) == [1]


def test_round_one_sizes_the_grouped_rows_to_the_pairs_an_expert_gets():
    qwen3 = SHAPES["qwen3-30b-a3b"]
    one = tune_moe.round_one(1, qwen3, 2)
    assert {config.path for config in one} == {"pairs", "grouped"}
    assert {config.block_size_m for config in one if config.path == "grouped"} == {16}
    large = tune_moe.round_one(4096, qwen3, 2)  # 256 pairs an expert
    assert {config.path for config in large} == {"grouped"}
    assert {config.block_size_m for config in large} == {32, 64, 128}
    for config in large:
        stages_bytes = tune_moe.shared_bytes(config.block_size_m, config.block_size_n, config.block_size_k,
                                             config.num_stages, 2)
        assert stages_bytes <= tune_moe.SHARED_MEMORY_BUDGET


def test_round_two_varies_one_setting_at_a_time():
    best = MoeConfig("grouped", 128, 128, 64, group_size_m=8, num_warps=4, num_stages=3)  # 48 KiB a stage
    variants = tune_moe.round_two(best, 2)
    changed = [{name for name in ("num_warps", "num_stages", "group_size_m")
                if getattr(variant, name) != getattr(best, name)} for variant in variants]
    assert all(len(names) == 1 for names in changed)
    assert {variant.num_warps for variant in variants} == {2, 4, 8}
    assert {variant.num_stages for variant in variants} == {1, 2, 3, 4}  # 5 stages overflow shared memory
    assert {variant.group_size_m for variant in variants} == {1, 8, 16}


def test_no_gpu_is_said_plainly():
    done = subprocess.run([sys.executable, str(ROOT / "tools/bench/kernels/tune_moe.py"), "--batches", "1"],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode != 0 and "needs a CUDA GPU (or --dry-run)" in done.stderr
