"""What the GPU benchmarks measure against, on the machine they run on: its read and copy
bandwidth and its bf16 matrix-product rate, and a timer for device work. torch is imported where
it is used: a benchmark's --help needs none of it."""

from __future__ import annotations

import os
import time


def machine() -> str:
    import torch
    import transformers
    import triton

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    return (f"{gpu}, {os.cpu_count()} CPUs, torch {torch.__version__}, triton {triton.__version__}, "
            f"transformers {transformers.__version__}")


def bench_ms(fn, warmup: int = 50, rep: int = 300) -> float:
    """Median milliseconds of `fn` on the device (events; warm-up and repeat in milliseconds)."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def read_bandwidth(device: str = "cuda") -> float:
    """Bytes/s reading 4 GiB once (a sum); on the CPU 512 MiB, the median of 5 sums."""
    import torch

    if device == "cpu":
        x = torch.rand(128 << 20)
        times = []
        for _ in range(5):
            started = time.perf_counter()
            x.sum()
            times.append(time.perf_counter() - started)
        return x.numel() * x.element_size() / sorted(times)[2]

    x = torch.empty(2 << 30, dtype=torch.bfloat16, device="cuda").uniform_()
    seconds = bench_ms(lambda: x.sum()) / 1e3
    del x
    return (4 << 30) / seconds


def copy_bandwidth() -> float:
    """Bytes/s of a 2 GiB device-to-device copy, bytes read plus written."""
    import torch

    src = torch.empty(1 << 30, dtype=torch.bfloat16, device="cuda").uniform_()
    dst = torch.empty_like(src)
    seconds = bench_ms(lambda: dst.copy_(src)) / 1e3
    return (4 << 30) / seconds


def matmul_rate() -> float:
    """FLOP/s of a bf16 8192^3 matrix product on random data."""
    import torch

    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    return 2 * 8192**3 / (bench_ms(lambda: a @ b) / 1e3)
