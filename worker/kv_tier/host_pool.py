"""The CPU tier's pool: one host tensor in the GPU pool's layout, allocated once, refused
beyond the host memory available, page-locked on CUDA (its copies: worker/kv_tier/copier.py);
and the rate of a copy from page-locked host memory to the device, timed at start-up."""

from __future__ import annotations

import os
import statistics
import time
import weakref
from collections.abc import Sequence

import torch


def host_memory_available() -> int | None:
    """Bytes of host memory available to a new allocation (MemAvailable); None when unknown."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None


def check_host_memory(size: int, size_setting: str = "cpu_offload_gb") -> None:
    """ValueError, with the numbers, when the CPU tier's `size` bytes exceed the host memory
    available now; it names the tier's size as the caller spells it (`size_setting`:
    `--cpu-offload-gb` for the command line, `cpu_offload_gb` for `LLM`)."""
    available = host_memory_available()
    if available is not None and size > available:
        raise ValueError(f"the CPU KV tier asks for {size / 2**30:.2f} GiB of host memory and "
                         f"{available / 2**30:.2f} GiB is available; lower {size_setting}")


def allocate_cpu_pool(num_blocks: int, block_shape: Sequence[int], dtype: torch.dtype, pinned: bool,
                      size_setting: str = "cpu_offload_gb") -> torch.Tensor:
    """The CPU tier's pool, refused (ValueError, with the numbers) beyond available host memory.
    Not zeroed: a CPU slot is only ever read after a store filled it.

    `pinned`: page-locked with cudaHostRegister, not `pin_memory=True`, whose caching allocator
    rounds a request up to a power of two (40 GiB would lock 64)."""
    size = num_blocks * torch.Size(block_shape).numel() * dtype.itemsize
    check_host_memory(size, size_setting)  # again: the weights took their share since the engine's first look
    pool = torch.empty((num_blocks, *block_shape), dtype=dtype)
    if pinned:
        cudart = torch.cuda.cudart()
        error = int(cudart.cudaHostRegister(pool.data_ptr(), pool.nbytes, 0))
        if error:
            raise RuntimeError(f"page-locking the CPU KV tier's {size / 2**30:.2f} GiB failed (CUDA error {error})")
        weakref.finalize(pool, cudart.cudaHostUnregister, pool.data_ptr())
    return pool


# Bytes a timed copy moves: on CUDA enough that a copy's fixed cost (~10 us) is ~0.4% of it at
# 55 GB/s, and little beside the memory a GPU pool leaves free; on the CPU, where the tier's
# copies are plain memory copies, less (every engine with a tier times one, tests' included).
TIMED_COPY_BYTES = 128 * 2**20
TIMED_HOST_COPY_BYTES = 4 * 2**20


def time_host_to_device(device: torch.device, repeats: int = 3) -> float:
    """Bytes a second of a copy from page-locked host memory to `device` (on the CPU, of a plain
    copy between two host buffers): the median of `repeats`, after one untimed copy. What the
    CPU tier's loads run at on their own (worker/driver/timing.py scales by it)."""
    on_cuda = device.type == "cuda"
    nbytes = TIMED_COPY_BYTES if on_cuda else TIMED_HOST_COPY_BYTES
    host = torch.empty(nbytes, dtype=torch.uint8)
    target = torch.empty(nbytes, dtype=torch.uint8, device=device)
    cudart = torch.cuda.cudart() if on_cuda else None
    if on_cuda and int(cudart.cudaHostRegister(host.data_ptr(), nbytes, 0)):
        raise RuntimeError(f"page-locking {nbytes} bytes to time a copy failed")
    try:
        target.copy_(host, non_blocking=on_cuda)
        times = []
        for _ in range(repeats):
            if on_cuda:
                started, finished = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                started.record()
                target.copy_(host, non_blocking=True)
                finished.record()
                finished.synchronize()
                times.append(started.elapsed_time(finished) / 1000)
            else:
                started_s = time.perf_counter()
                target.copy_(host)
                times.append(time.perf_counter() - started_s)
    finally:
        if on_cuda:
            torch.cuda.synchronize(device)
            cudart.cudaHostUnregister(host.data_ptr())
    return nbytes / statistics.median(times)
