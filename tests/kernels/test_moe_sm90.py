"""The fused MoE kernels compile for sm_90 (Hopper) at the model shapes with their default tiles,
integers specialised to 1 included, within a Hopper SM's shared memory; the grouped products
use tensor cores and asynchronous copies, the pairs path wide loads; with bf16 weights and with
fp8 ones. Run in a process of its own
(tests/kernels/moe_sm90.py): these tests' TRITON_INTERPRET=1 would make the kernels uncompilable."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
HOPPER_SHARED_BYTES = 227 * 1024


def compiled(*args: str) -> dict[str, dict]:
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(HERE / "moe_sm90.py"), *args], capture_output=True, text=True,
                          timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    launches = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert all(launch["shared"] <= HOPPER_SHARED_BYTES for launch in launches), launches
    return {launch["kernel"]: launch for launch in launches}


def test_one_token_of_qwen3_30b_a3b_takes_the_pairs_kernels_with_wide_loads():
    launches = compiled("1", "8", "128", "2048", "768")
    assert list(launches) == ["_pair_gate_up_kernel", "_pair_down_kernel"]
    assert all(launch["ops"]["ld.global.v4"] > 0 for launch in launches.values())


def test_a_lone_pair_compiles_with_its_counts_specialised_to_1():
    launches = compiled("1", "1", "4", "2048", "768", json.dumps({"path": "grouped"}))
    assert list(launches) == ["_align_kernel", "_grouped_gate_up_kernel", "_grouped_down_kernel"]


def test_large_batches_sort_in_chunks_and_multiply_on_tensor_cores():
    for shape in (("256", "8", "128", "2048", "768"), ("4096", "2", "8", "4096", "14336")):
        launches = compiled(*shape)
        assert list(launches) == ["_count_chunks_kernel", "_place_chunks_kernel", "_grouped_gate_up_kernel",
                                  "_grouped_down_kernel", "_sum_choices_kernel"]
        for name in ("_grouped_gate_up_kernel", "_grouped_down_kernel"):
            ops = launches[name]["ops"]
            assert ops["wgmma"] + ops["mma.sync"] > 0 and ops["cp.async.cg"] > 0, (shape, name, ops)


def test_fp8_weights_compile_on_both_paths_widened_for_the_products():
    """Weight-only fp8: one token's pairs kernels still load 16 bytes at a time (16 fp8 weights
    each), a large batch's grouped products still run on tensor cores fed by asynchronous copies."""
    pairs = compiled("1", "8", "128", "2048", "768", "--fp8-weights")
    assert list(pairs) == ["_pair_gate_up_kernel", "_pair_down_kernel"]
    assert all(launch["ops"]["ld.global.v4"] > 0 for launch in pairs.values())
    grouped = compiled("4096", "2", "8", "4096", "14336", "--fp8-weights")
    for name in ("_grouped_gate_up_kernel", "_grouped_down_kernel"):
        ops = grouped[name]["ops"]
        assert ops["wgmma"] + ops["mma.sync"] > 0 and ops["cp.async.cg"] > 0, (name, ops)
