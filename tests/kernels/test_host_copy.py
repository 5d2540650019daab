"""kernels/host_copy.py: a copy between pinned host memory and the GPU by a kernel, which must
not wait behind a bulk transfer that another stream queued on a copy engine (the CPU tier's loads
and stores); on the CPU through Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

from spillway.kernels.host_copy import BLOCK, copy_by_kernel

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("size", [1, BLOCK - 1, BLOCK, 3 * BLOCK + 5])
def test_the_copy_moves_every_element_and_nothing_past_them(dtype, size):
    src = torch.arange(1, size + 1, dtype=dtype)
    dst = torch.zeros(size + 3, dtype=dtype)
    copy_by_kernel(dst[:size], src)
    assert torch.equal(dst[:size], src) and not dst[size:].any()


@pytest.mark.parametrize("dst, src, message", [
    (torch.zeros(4, dtype=torch.int32), torch.zeros(4, dtype=torch.int64), "dtypes differ"),
    (torch.zeros(4, dtype=torch.int32), torch.zeros(5, dtype=torch.int32), "sizes differ"),
    (torch.zeros(8, dtype=torch.int32)[::2], torch.zeros(4, dtype=torch.int32), "contiguous"),
])
def test_bad_arguments_are_refused_by_name(dst, src, message):
    with pytest.raises(ValueError, match=message):
        copy_by_kernel(dst, src)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("direction", ["to GPU", "to host"])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_a_copy_by_kernel_is_exact_both_ways_on_cuda(direction, dtype):
    host = torch.arange(5000, dtype=dtype).pin_memory()
    device = torch.zeros_like(host, device="cuda")
    if direction == "to GPU":
        copy_by_kernel(device, host)
    else:
        device.copy_(host)
        host.zero_()
        copy_by_kernel(host, device)
    torch.cuda.synchronize()
    assert torch.equal(device.cpu(), torch.arange(5000, dtype=dtype))
    assert torch.equal(host, torch.arange(5000, dtype=dtype))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("direction", ["to GPU", "to host"])
def test_a_small_copy_by_kernel_does_not_wait_behind_a_bulk_copy_of_another_stream(direction):
    """1 GiB each way on a side stream (a CPU-tier load or store), then a 16 KiB copy on the
    compute stream: it lands long before the bulk copy does."""
    bulk_host = torch.empty(2**30, dtype=torch.uint8).pin_memory()
    bulk_device = torch.empty_like(bulk_host, device="cuda")
    small_host = torch.arange(4096, dtype=torch.int32).pin_memory()
    small_device = torch.arange(4096, dtype=torch.int32, device="cuda")
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        if direction == "to GPU":
            bulk_device.copy_(bulk_host, non_blocking=True)
        else:
            bulk_host.copy_(bulk_device, non_blocking=True)
    bulk_done = side.record_event()
    if direction == "to GPU":
        copy_by_kernel(small_device, small_host)
    else:
        copy_by_kernel(small_host, small_device)
    small_done = torch.cuda.current_stream().record_event()
    small_done.synchronize()
    assert not bulk_done.query()  # ~20 ms of bulk copy still running
    bulk_done.synchronize()
    assert torch.equal(small_device.cpu(), small_host)
    # The same small copy on a copy engine, for the record (how the hardware orders it).
    with torch.cuda.stream(side):
        if direction == "to GPU":
            bulk_device.copy_(bulk_host, non_blocking=True)
        else:
            bulk_host.copy_(bulk_device, non_blocking=True)
    bulk_done = side.record_event()
    if direction == "to GPU":
        small_device.copy_(small_host, non_blocking=True)
    else:
        small_host.copy_(small_device, non_blocking=True)
    small_done = torch.cuda.current_stream().record_event()
    small_done.synchronize()
    print(f"{direction}: a 16 KiB copy_ beside a 1 GiB one on another stream "
          f"{'waited for it' if bulk_done.query() else 'did not wait'}")
    bulk_done.synchronize()
