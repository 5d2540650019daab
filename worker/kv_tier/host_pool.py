"""The CPU tier's pool: one host tensor in the GPU pool's layout, allocated once, refused
beyond the host memory available, page-locked on CUDA (its copies: worker/kv_tier/copier.py)."""

from __future__ import annotations

import os
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
