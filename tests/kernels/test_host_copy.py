"""kernels/host_copy.py: a copy between pinned host memory and the GPU by a kernel, which must
not wait behind a bulk transfer that another stream queued on a copy engine (the CPU tier's loads
and stores); on the CPU through Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

from kernel_testing import gpu
from spillway.kernels.host_copy import BLOCK, copy_by_kernel


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


@gpu[0]
@gpu[1]
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


def small_copy_beside_a_bulk_one(direction: str, copy) -> tuple[bool, bool]:
    """1 GiB copied `direction` on a side stream (a CPU-tier load or store), then 16 KiB the
    same way on the compute stream by `copy(dst, src)`: whether the bulk copy was still running
    when the small one had landed, and whether the small one's bytes arrived."""
    bulk_host = torch.empty(2**30, dtype=torch.uint8).pin_memory()
    bulk_device = torch.empty_like(bulk_host, device="cuda")
    expected = torch.arange(4096, dtype=torch.int32)
    small_host = (expected if direction == "to GPU" else torch.zeros_like(expected)).pin_memory()
    small_device = (torch.zeros_like(expected) if direction == "to GPU" else expected).to("cuda")
    src, dst = (bulk_host, bulk_device) if direction == "to GPU" else (bulk_device, bulk_host)
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        dst.copy_(src, non_blocking=True)
    bulk_done = side.record_event()
    if direction == "to GPU":
        copy(small_device, small_host)
    else:
        copy(small_host, small_device)
    torch.cuda.current_stream().record_event().synchronize()
    still_running = not bulk_done.query()
    torch.cuda.synchronize()
    return still_running, torch.equal(small_device.cpu(), expected) and torch.equal(small_host, expected)


@gpu[0]
@gpu[1]
@pytest.mark.parametrize("direction", ["to GPU", "to host"])
def test_a_small_copy_by_kernel_does_not_wait_behind_a_bulk_copy_of_another_stream(direction):
    still_running, arrived = small_copy_beside_a_bulk_one(direction, copy_by_kernel)
    assert still_running and arrived  # ~20 ms of bulk copy still to go when it landed
    # The same small copy on a copy engine, for the record (how the hardware orders it).
    still_running, _ = small_copy_beside_a_bulk_one(direction, lambda dst, src: dst.copy_(src, non_blocking=True))
    print(f"{direction}: a 16 KiB copy_ beside a 1 GiB one on another stream "
          f"{'did not wait' if still_running else 'waited for it'}")
