"""Copies of blocks between the GPU pool and the CPU tier: whole blocks, or a slice of their layers.

A block is one contiguous span `[num_layers, kv_sides, block_size, kv_heads, head_dim]` (two
sides for keys and values, one for an MLA model's latent rows), so the slice
of layers `[first, first + count)` of a run of consecutive blocks is a pitched (2D) region:
`length` rows of `count` layers' bytes, a block's bytes apart. Loading a long prefix in such
slices, first layers first (worker/kv_tier/paced_loads.py), lets a forward start on the first layers
while the last ones still arrive (worker/kv_tier/copier.py).

On CUDA a slice of a run is one pitched DMA transfer: the driver's `cuMemcpy2DAsync`, through
ctypes (torch copies a strided host tensor to the GPU through a contiguous host temporary,
synchronously). Elsewhere it is a tensor copy, which is also the reference.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

_MEMORY_UNIFIED = 4  # CU_MEMORYTYPE_UNIFIED: a pointer of the unified address space, host or device


class _Memcpy2D(ctypes.Structure):
    """The driver's CUDA_MEMCPY2D."""

    _fields_ = [
        ("srcXInBytes", ctypes.c_size_t), ("srcY", ctypes.c_size_t),
        ("srcMemoryType", ctypes.c_int), ("srcHost", ctypes.c_void_p), ("srcDevice", ctypes.c_uint64),
        ("srcArray", ctypes.c_void_p), ("srcPitch", ctypes.c_size_t),
        ("dstXInBytes", ctypes.c_size_t), ("dstY", ctypes.c_size_t),
        ("dstMemoryType", ctypes.c_int), ("dstHost", ctypes.c_void_p), ("dstDevice", ctypes.c_uint64),
        ("dstArray", ctypes.c_void_p), ("dstPitch", ctypes.c_size_t),
        ("WidthInBytes", ctypes.c_size_t), ("Height", ctypes.c_size_t),
    ]


def copy_blocks(src: torch.Tensor, dst: torch.Tensor, pairs: Sequence[tuple[int, int]]) -> None:
    """`dst[d] = src[s]` for every `(s, d)` in `pairs`, in order, on the current stream
    (asynchronously between pinned host memory and a GPU), a copy per run (`block_runs`).
    A benchmark times this between a pool and the other."""
    copy_runs(src, dst, block_runs(pairs))


def copy_runs(src: torch.Tensor, dst: torch.Tensor, runs: Sequence[tuple[int, int, int]]) -> None:
    """`copy_blocks` of the runs `block_runs` found."""
    non_blocking = src.device.type != dst.device.type
    for src_start, dst_start, length in runs:
        dst[dst_start:dst_start + length].copy_(src[src_start:src_start + length], non_blocking=non_blocking)


def block_runs(pairs: Sequence[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """`pairs` as runs of consecutive slots on both sides, (src start, dst start, length), in
    order. A run may go down as well as up: the LRU evicts a sequence's blocks from its last,
    so its write-back takes CPU slots in the reverse of its order and a reload finds them,
    and the GPU slots it is given, descending (a 10k-token prefix: one copy, not 626). A run's
    slots are all distinct, so copying it ascending writes what copying it in order would."""
    runs = []
    index, count = 0, len(pairs)
    while index < count:
        first_src, first_dst = pairs[index]
        step = -1 if index + 1 < count and pairs[index + 1] == (first_src - 1, first_dst - 1) else 1
        length = 1
        while (index + length < count and pairs[index + length][0] == first_src + step * length
               and pairs[index + length][1] == first_dst + step * length):
            length += 1
        if step == 1:
            runs.append((first_src, first_dst, length))
        else:
            runs.append((first_src - length + 1, first_dst - length + 1, length))
        index += length
    return runs


_driver = None


def _memcpy_2d_async():
    """The driver's `cuMemcpy2DAsync`, loaded once."""
    global _driver
    if _driver is None:
        library = ctypes.CDLL("libcuda.so.1")
        function = library.cuMemcpy2DAsync_v2
        function.argtypes, function.restype = [ctypes.POINTER(_Memcpy2D), ctypes.c_void_p], ctypes.c_int
        _driver = function
    return _driver


def copy_layers(src: torch.Tensor, dst: torch.Tensor, runs: Sequence[tuple[int, int, int]], first: int,
                count: int) -> None:
    """`dst[d, first:first + count] = src[s, first:first + count]` for every block of `runs`
    (`block_runs` of the (s, d) pairs), on the current stream (asynchronously between pinned
    host memory and a GPU), a transfer per run."""
    if src.device.type != "cuda" and dst.device.type != "cuda":
        for src_start, dst_start, length in runs:
            dst[dst_start:dst_start + length, first:first + count] = src[src_start:src_start + length,
                                                                         first:first + count]
        return
    assert src.is_contiguous() and dst.is_contiguous() and src.shape[1:] == dst.shape[1:]
    block_bytes, layer_bytes = src[0].nbytes, src[0, 0].nbytes
    copy = _memcpy_2d_async()
    stream = torch.cuda.current_stream(dst.device if dst.device.type == "cuda" else src.device).cuda_stream
    for src_start, dst_start, length in runs:
        region = _Memcpy2D(
            srcMemoryType=_MEMORY_UNIFIED, srcDevice=src.data_ptr() + src_start * block_bytes + first * layer_bytes,
            srcPitch=block_bytes,
            dstMemoryType=_MEMORY_UNIFIED, dstDevice=dst.data_ptr() + dst_start * block_bytes + first * layer_bytes,
            dstPitch=block_bytes,
            WidthInBytes=count * layer_bytes, Height=length)
        status = copy(ctypes.byref(region), ctypes.c_void_p(stream))
        if status != 0:
            raise RuntimeError(f"cuMemcpy2DAsync failed with CUDA error {status} (layers {first}-"
                               f"{first + count - 1} of {length} blocks)")
