"""tools/bench_attention.py's arguments on the CPU (the timings need a GPU)."""

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tools.bench_attention import parse_shape

ROOT = Path(__file__).resolve().parents[2]


def test_shapes_parse_and_bad_ones_are_refused():
    assert parse_shape("64x4096") == (64, 4096, 4096)
    assert parse_shape("512x1000-2000") == (512, 1000, 2000)
    for bad in ("64", "64x", "0x10", "8x20-10", "ax4"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_shape(bad)


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # as on a machine without a GPU
    return subprocess.run([sys.executable, str(ROOT / "tools" / "bench_attention.py"), *args],
                          capture_output=True, text=True, timeout=120, env=env)


def test_a_bad_shape_is_a_usage_error_and_no_gpu_is_said_plainly():
    result = _run("--shapes", "64x4096,8x20-10")
    assert result.returncode == 2 and "LOW <= HIGH" in result.stderr and "Traceback" not in result.stderr
    result = _run("--shapes", "2x16")
    assert result.returncode != 0 and "needs a CUDA GPU" in result.stderr
