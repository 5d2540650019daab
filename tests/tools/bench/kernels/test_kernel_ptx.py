"""tools/bench/kernels/ptx.py on the CPU: the decode kernel compiled for sm_90, its loops counted.

The float8 cache's values are stored transposed so the kernel reads them like the keys; if a
change brought back byte-by-byte shared-memory loads of V (what made the kernel
instruction-bound), or a second set of tile buffers, these counts would show it. The tool runs
in its own process: the kernel tests' TRITON_INTERPRET=1 would make the kernel uncompilable."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]


def _compile(*args: str) -> dict:
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "bench" / "kernels" / "ptx.py"), "--json", *args],
                            capture_output=True, text=True, timeout=300, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def _main_loop(*args: str) -> tuple[int, dict[str, int]]:
    counts = _compile(*args)
    # The pipelined loop over whole tiles is the one with asynchronous copies.
    pipelined = [loop["ops"] for loop in counts["loops"] if any(op.startswith("cp.async.cg") for op in loop["ops"])]
    assert len(pipelined) == 1, counts
    return counts["shared"], pipelined[0]


def _wide_copies(ops: dict[str, int]) -> int:
    return sum(n for op, n in ops.items() if op.startswith("cp.async.cg"))


def test_fp8_decode_loop_reads_values_in_wide_copies_and_holds_one_set_of_buffers():
    shared, ops = _main_loop("--cache-dtype", "fp8", "--block-n", "128", "--warps", "2", "--stages", "3")
    assert ops.get("ld.shared.b8", 0) == 0
    assert _wide_copies(ops) == 2 * 128 * 128 // 16 // 64  # a 128 x 128 byte tile of K and of V, 64 threads
    assert shared < 64 * 1024


def test_one_loop_option_folds_the_masked_tail_into_the_pipelined_loop():
    default, one_loop = _compile("--cache-dtype", "fp8"), _compile("--cache-dtype", "fp8", "--one-loop")
    assert len(default["loops"]) == 2 and len(one_loop["loops"]) == 1
    assert one_loop["shared"] == default["shared"]


def test_bf16_decode_loop_reads_tiles_in_wide_copies():
    _, ops = _main_loop("--cache-dtype", "bf16", "--block-n", "64", "--warps", "4", "--stages", "2")
    assert ops.get("ld.shared.b8", 0) == 0
    assert _wide_copies(ops) == 2 * 64 * 128 * 2 // 16 // 128
