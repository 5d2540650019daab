"""tools/kernel_ptx.py on the CPU: the decode kernel compiled for sm_90, loops counted.

The float8 cache's values are stored transposed so the kernel reads them like the keys; if a
change brought back byte-by-byte shared-memory loads of V (what made the kernel
instruction-bound), or a second set of tile buffers, these counts would show it."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tools.kernel_ptx import compile_decode, loop_histograms  # noqa: E402


def _main_loop(cache_dtype: str, block_n: int, warps: int, stages: int):
    kernel = compile_decode(cache_dtype, block_n, warps, stages, capability=90)
    loops = loop_histograms(kernel.asm["ptx"])
    assert loops, "no loop in the PTX"
    # The pipelined loop over whole tiles is the one with asynchronous copies.
    pipelined = [ops for _, ops in loops if any(op.startswith("cp.async.cg") for op in ops)]
    assert len(pipelined) == 1
    return kernel, pipelined[0]


def test_fp8_decode_loop_reads_values_in_wide_copies_and_holds_one_set_of_buffers():
    kernel, ops = _main_loop("fp8", 128, 2, 3)
    assert ops["ld.shared.b8"] == 0
    # A 128 x 128 byte tile of keys and one of values: 16 bytes per copy, 64 threads.
    assert sum(n for op, n in ops.items() if op.startswith("cp.async.cg")) == 2 * 128 * 128 // 16 // 64
    assert kernel.metadata.shared < 64 * 1024


def test_bf16_decode_loop_is_unchanged_in_kind():
    kernel, ops = _main_loop("bf16", 64, 4, 2)
    assert ops["ld.shared.b8"] == 0
    assert sum(n for op, n in ops.items() if op.startswith("cp.async.cg")) == 2 * 64 * 128 * 2 // 16 // 128
