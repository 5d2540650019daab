"""Small copies between pinned host memory and the GPU, done by a kernel instead of a copy engine.

A `copy_(..., non_blocking=True)` between pinned host memory and the GPU is a DMA transfer on a
copy engine, and the copy engines run transfers of one direction in turn whatever stream queued
them: a step's few kilobytes of staged inputs queued behind a CPU-tier load of half a gigabyte on
the load stream wait for all of it (~10 ms), and so does the forward that reads them; the
sampled tokens' copy back waits behind the stores the same way. This kernel moves the bytes
with the multiprocessors instead, reading or writing the pinned memory over the bus (it is
mapped into the GPU's address space), so it only waits for what its own stream queued before.

On any other device it runs through Triton's interpreter, like every kernel here.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from spillway.kernels.utils import check, for_device, wait_for_inputs

BLOCK = 1024  # elements a program moves


@triton.jit(do_not_specialize=["num_elements"])
def _copy_kernel(src_ptr, dst_ptr, num_elements, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_inputs(PDL)
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < num_elements
    tl.store(dst_ptr + offsets, tl.load(src_ptr + offsets, mask=mask), mask=mask)


def copy_by_kernel(dst: torch.Tensor, src: torch.Tensor) -> None:
    """`dst.copy_(src)` for two contiguous tensors of one dtype and size, one of them on the GPU
    and the other in pinned host memory (or both on the CPU), queued on the current stream."""
    check(dst.dtype == src.dtype, f"dtypes differ: {dst.dtype} and {src.dtype}")
    check(dst.numel() == src.numel(), f"sizes differ: {dst.numel()} and {src.numel()}")
    check(dst.is_contiguous() and src.is_contiguous(), "both tensors must be contiguous")
    device = dst.device if dst.device.type == "cuda" else src.device
    if device.type == "cuda":
        host = src if dst.device.type == "cuda" else dst
        check(host.device.type == device.type or host.is_pinned(),
              "the host side must be pinned memory: the kernel reads or writes it over the bus")
    if not src.numel():
        return
    num_elements = src.numel()
    for_device(_copy_kernel, device)[(triton.cdiv(num_elements, BLOCK),)](
        src, dst, num_elements, BLOCK=BLOCK, num_warps=4)


def warm_up_copies(device: torch.device) -> None:
    """Compile the kernel's variants the engine uses (int32 inputs in, int64 tokens out) before
    the first request, so that no step waits for a compile."""
    for dtype in (torch.int32, torch.int64):
        host = torch.zeros(BLOCK + 1, dtype=dtype, pin_memory=device.type == "cuda")
        on_device = torch.ones_like(host, device=device)
        copy_by_kernel(host, on_device)
        copy_by_kernel(on_device, host)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
