"""tools/bench/kernels/moe.py on the CPU: its arguments and a row's roofline arithmetic (the
timings need a GPU)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[4]

from spillway.tools.bench.kernels import moe, moe_cases  # noqa: E402

QWEN3 = moe_cases.SHAPES["qwen3-30b-a3b"]


def test_a_row_against_its_bounds():
    # 8 experts of 3 x 2048 x 768 bf16 (75.5 MB) and one token in and out, at 4 TB/s and 800 TFLOP/s.
    row = moe.roofline_row(QWEN3, 1, kernel_us=25.0, baseline_us=500.0, distinct=8, element_size=2,
                           bandwidth=4e12, matmul_rate=8e14)
    assert row["bytes"] == 8 * 3 * 2048 * 768 * 2 + 2 * 2048 * 2
    assert row["flops"] == 2 * 8 * 3 * 2048 * 768
    assert row["byte_bound_us"] == pytest.approx(1e6 * row["bytes"] / 4e12)
    assert row["flop_bound_us"] == pytest.approx(1e6 * row["flops"] / 8e14)
    assert row["of_roofline"] == pytest.approx(row["byte_bound_us"] / 25.0)
    assert row["speedup"] == 20.0


def test_fp8_weights_count_a_byte_a_weight_and_a_scale_a_row():
    row = moe.roofline_row(QWEN3, 1, kernel_us=15.0, baseline_us=25.0, distinct=8, element_size=2,
                           bandwidth=4e12, matmul_rate=8e14, fp8_weights=True)
    assert row["bytes"] == 8 * (3 * 2048 * 768 + 4 * (2 * 768 + 2048)) + 2 * 2048 * 2
    assert row["speedup"] == pytest.approx(25.0 / 15.0)


def test_fp8_layers_carry_their_row_scales():
    import torch

    tiny = moe_cases.MoeShape("tiny", 4, 48, 40, 2)
    w13, w2 = moe_cases.expert_weights(tiny, torch.float32, torch.device("cpu"), seed=0)
    stacks = moe_cases.fp8_expert_weights(w13, w2)
    (plain,), (fp8,) = (moe_cases.layers_for(tiny, [weights], 3, torch.float32, torch.device("cpu"))
                        for weights in ((w13, w2), stacks))
    assert plain.scales() == {} and torch.equal(plain.hidden, fp8.hidden)
    assert fp8.w13.dtype == torch.float8_e4m3fn and set(fp8.scales()) == {"w13_scale", "w2_scale"}
    assert fp8.scales()["w13_scale"].shape == (4, 80) and fp8.scales()["w2_scale"].shape == (4, 48)


def test_the_flop_bound_rules_a_large_batch():
    row = moe.roofline_row(QWEN3, 4096, kernel_us=600.0, baseline_us=6000.0, distinct=128, element_size=2,
                           bandwidth=4e12, matmul_rate=8e14)
    assert row["flop_bound_us"] > row["byte_bound_us"]
    assert row["of_roofline"] == pytest.approx(row["flop_bound_us"] / 600.0)


def test_weight_copies_overflow_l2_within_the_memory_budget():
    l2 = 50 << 20
    assert moe_cases.layer_copies(QWEN3, 2, l2, 100 << 30) == 3  # 4 x 50 MiB over 75.5 MB a call
    assert moe_cases.layer_copies(QWEN3, 2, l2, 2 << 30) == 1  # one 1.2 GB copy fits 2 GiB
    mixtral = moe_cases.SHAPES["mixtral-8x7b"]
    assert moe_cases.layer_copies(mixtral, 2, l2, 100 << 30) == 2


def test_arguments_parse_and_bad_ones_are_refused():
    assert moe.parse_tokens("1,8,64") == [1, 8, 64]
    assert [shape.name for shape in moe.parse_shapes("mixtral-8x7b")] == ["mixtral-8x7b"]
    for bad in ("0", "a", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            moe.parse_tokens(bad)
    with pytest.raises(argparse.ArgumentTypeError, match="unknown shapes"):
        moe.parse_shapes("qwen3-30b-a3b,llama")


def test_no_gpu_is_said_plainly():
    done = subprocess.run([sys.executable, str(ROOT / "tools/bench/kernels/moe.py"), "--tokens", "1"],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode != 0 and "needs a CUDA GPU" in done.stderr
