"""tools/bench/kernels/attention.py's arguments on the CPU (the timings need a GPU)."""

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from spillway.tools.bench.kernels.attention import parse_shape

ROOT = Path(__file__).resolve().parents[4]


def test_shapes_parse_and_bad_ones_are_refused():
    assert parse_shape("64x4096") == (64, 4096, 4096)
    assert parse_shape("512x1000-2000") == (512, 1000, 2000)
    for bad in ("64", "64x", "0x10", "8x20-10", "ax4"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_shape(bad)


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # as on a machine without a GPU
    return subprocess.run([sys.executable, str(ROOT / "tools" / "bench" / "kernels" / "attention.py"), *args],
                          capture_output=True, text=True, timeout=120, env=env)


def test_a_bad_shape_is_a_usage_error_and_no_gpu_is_said_plainly():
    result = _run("--shapes", "64x4096,8x20-10")
    assert result.returncode == 2 and "LOW <= HIGH" in result.stderr and "Traceback" not in result.stderr
    result = _run("--shapes", "2x16")
    assert result.returncode != 0 and "needs a CUDA GPU" in result.stderr


def test_convoys_parse_and_bad_ones_are_refused():
    from spillway.tools.bench.kernels.attention import parse_convoy

    assert parse_convoy("50x4@10000") == (50, 4, 10000)
    for bad in ("50x4", "1x4@1024", "50x0@1024", "50x4@1000", "ax4@1024"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_convoy(bad)
    result = _run("--convoy", "50x4@1000")
    assert result.returncode == 2 and "multiple of 16" in result.stderr and "Traceback" not in result.stderr
    result = _run("--convoy")
    assert result.returncode != 0 and "needs a CUDA GPU" in result.stderr


def test_convoy_paths_agree_on_the_cpu():
    """The benchmark's own inputs and launches, small, through Triton's interpreter: the shared
    prefix is found where it was built, and cascade attention equals the prefill kernel."""
    import torch

    from spillway.tools.bench.kernels.convoy import convoy_inputs, convoy_launches, detection_us, kv_bytes

    convoy = convoy_inputs(3, 2, 1024, heads=(4, 2, 32), dtype=torch.float32, device="cpu")
    detection_us(convoy, repeats=1)  # asserts the prefix found is the one built
    assert kv_bytes(convoy, cascade=False) - kv_bytes(convoy, cascade=True) == 2 * 1024 * 2 * 32 * 2 * 4
    launches = convoy_launches(convoy, split_counts=(3,))
    assert list(launches) == ["prefill kernel", "cascade, default: 4 splits", "cascade, graph: 6 splits",
                              "cascade, 3 splits"]
    outputs = [launch() for launch in launches.values()]
    for out in outputs[1:]:
        assert float((out - outputs[0]).norm() / outputs[0].norm()) < 1e-5
