"""A CPU worker's memory stays bounded however many step sizes its packed linear layers meet.

oneDNN and torch's ideep layer each keep a compiled kernel per input shape; `pack_linear_layers`
caps both caches. The caps are read once per process, at its first oneDNN product, so the sweep
runs in a fresh interpreter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

# Packs three layers of different shapes, fills the caches with the first row counts, then
# reports the malloc'd bytes the next row counts add (each one new to both caches).
SWEEP = """
import ctypes, json
import torch
from torch import nn
from spillway.worker.models.cpu_linear import CACHED_KERNELS, pack_linear_layers, padded_rows


class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                                     "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


mallinfo2 = ctypes.CDLL(None).mallinfo2
mallinfo2.restype = MallInfo2
model = nn.Sequential(nn.Linear(16, 24), nn.Linear(24, 8), nn.Linear(8, 16))
assert pack_linear_layers(model) == 3
counts = sorted({padded_rows(rows) for rows in range(1, 8193)})
filled = CACHED_KERNELS // 3 + 1
with torch.no_grad():
    for rows in counts[:filled]:
        model(torch.zeros(rows, 16))
    before = mallinfo2().uordblks
    for rows in counts[filled:]:
        model(torch.zeros(rows, 16))
    grown = mallinfo2().uordblks - before
print(json.dumps({"new_counts": len(counts) - filled, "grown_bytes": grown}))
"""


def test_kernel_caches_stop_growing_once_full():
    env = {name: value for name, value in os.environ.items()
           if name not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")}
    result = subprocess.run([sys.executable, "-c", SWEEP], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.splitlines()[-1])
    assert report["new_counts"] >= 50
    # Unbounded (both caps at 1,024), the new row counts kept 128 MB here: ~0.58 MB per count and layer.
    assert report["grown_bytes"] < 1_000_000, report
