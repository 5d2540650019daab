"""The MLA decode and prefill kernels (and the decode's split reduction) compile for sm_90
(Hopper) at DeepSeek's latent rows with their default launch settings, within a Hopper SM's
shared memory, their products on the matrix units; over a bf16 cache the rows come in through
asynchronous copies. Run in a process of its own (tests/kernels/mla_sm90.py): these tests'
TRITON_INTERPRET=1 would make the kernels uncompilable."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
HOPPER_SHARED_BYTES = 227 * 1024


@pytest.mark.parametrize("heads, cache_dtype", [("16", "bf16"), ("128", "bf16"), ("128", "fp8")])
def test_the_latent_kernels_compile_for_hopper(heads, cache_dtype):
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(HERE / "mla_sm90.py"), heads, cache_dtype], capture_output=True,
                          text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    launches = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [launch["kernel"] for launch in launches] == [
        "_mla_decode_kernel", "_mla_decode_kernel", "_reduce_splits_kernel", "_mla_prefill_kernel"]
    assert all(launch["shared"] <= HOPPER_SHARED_BYTES for launch in launches), launches
    for launch in launches:
        if launch["kernel"] != "_reduce_splits_kernel":
            assert launch["ops"]["mma.sync"] + launch["ops"]["wgmma"] > 0, launch
            assert cache_dtype == "fp8" or launch["ops"]["cp.async.cg"] > 0, launch
