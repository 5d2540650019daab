"""Copies of whole blocks and of a slice of their layers between two pools: on the CPU
(tensor copies), and on a GPU from pinned host memory (one pitched transfer per run)."""

from __future__ import annotations

import pytest
import torch

from spillway.worker.kv_tier.block_copies import block_runs, copy_blocks, copy_layers
from spillway.worker.kv_tier.host_pool import allocate_cpu_pool

SHAPE = (5, 2, 4, 3, 8)  # layers, K/V, block size, KV heads, head dim


def numbered_pool(num_blocks: int, device: str = "cpu", pinned: bool = False) -> torch.Tensor:
    pool = allocate_cpu_pool(num_blocks, SHAPE, torch.float32, pinned=pinned) if device == "cpu" else None
    values = torch.arange(num_blocks * torch.Size(SHAPE).numel(), dtype=torch.float32).view(num_blocks, *SHAPE)
    if pool is None:
        return values.to(device)
    pool.copy_(values)
    return pool


PAIRS = ((3, 9), (4, 10), (5, 11), (8, 2), (7, 1), (0, 6))  # an ascending run, a descending one, a single


def expected_after(src: torch.Tensor, dst: torch.Tensor, first: int, count: int) -> torch.Tensor:
    expected = dst.clone()
    for src_slot, dst_slot in PAIRS:
        expected[dst_slot, first:first + count] = src[src_slot, first:first + count]
    return expected


@pytest.mark.parametrize("first,count", [(0, 1), (1, 3), (4, 1), (0, 5)])
def test_a_slice_of_layers_lands_in_its_blocks_and_nothing_else_changes(first, count):
    src, dst = numbered_pool(12), -numbered_pool(12)
    expected = expected_after(src, dst, first, count)
    copy_layers(src, dst, block_runs(PAIRS), first, count)
    assert torch.equal(dst, expected)


def test_every_layer_one_at_a_time_is_the_whole_block_copy():
    src = numbered_pool(12)
    by_layer, whole = torch.zeros_like(src), torch.zeros_like(src)
    for layer in range(SHAPE[0]):
        copy_layers(src, by_layer, block_runs(PAIRS), layer, 1)
    copy_blocks(src, whole, PAIRS)
    assert torch.equal(by_layer, whole)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("first,count", [(0, 1), (1, 3), (0, 5)])
def test_a_slice_of_layers_goes_from_pinned_memory_to_the_gpu_and_back_byte_for_byte(first, count):
    host, device = numbered_pool(12, pinned=True), -numbered_pool(12, "cuda")
    expected = expected_after(host, device.cpu(), first, count)
    copy_layers(host, device, block_runs(PAIRS), first, count)
    torch.cuda.synchronize()
    assert torch.equal(device.cpu(), expected)
    back = allocate_cpu_pool(12, SHAPE, torch.float32, pinned=True)
    back.zero_()
    copy_layers(device, back, block_runs([(dst, src) for src, dst in PAIRS]), first, count)
    torch.cuda.synchronize()
    reference = torch.zeros_like(back)
    for src_slot, dst_slot in PAIRS:
        reference[src_slot, first:first + count] = host[src_slot, first:first + count]
    assert torch.equal(back, reference)
