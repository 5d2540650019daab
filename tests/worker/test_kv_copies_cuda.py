"""KVCopier on CUDA: the copy stream's order against compute (skipped without a GPU).

The pools are large enough (a few hundred MiB a step) that a copy running unordered beside
the compute stream's writes would read or leave the wrong bytes."""

from __future__ import annotations

import pytest
import torch

from spillway.worker.kv_copies import KVCopier, allocate_cpu_pool
from spillway.worker.step_plan import KVCopies

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

BLOCK_SHAPE = (8, 2, 16, 8, 128)  # 512 KiB per block in bfloat16
NUM_BLOCKS = 1024


def pools() -> tuple[torch.Tensor, torch.Tensor]:
    gpu = torch.zeros((NUM_BLOCKS, *BLOCK_SHAPE), dtype=torch.bfloat16, device="cuda")
    cpu = allocate_cpu_pool(NUM_BLOCKS, BLOCK_SHAPE, torch.bfloat16, pinned=True)
    cpu.zero_()
    return gpu, cpu


def test_the_pool_is_page_locked_at_its_own_size():
    _, cpu = pools()
    pinned, nbytes = cpu.is_pinned(), cpu.untyped_storage().nbytes()  # plain values: no storage repr on failure
    assert pinned
    assert nbytes == NUM_BLOCKS * 512 * 1024


def test_a_store_reads_what_compute_wrote_before_it_and_not_what_compute_writes_after():
    gpu, cpu = pools()
    copier = KVCopier(gpu, cpu)
    half = NUM_BLOCKS // 2
    torch.cuda._sleep(50_000_000)  # compute is busy when the copies are issued
    gpu[:half].fill_(1.0)  # written by the steps before
    # Scattered pairs (no two consecutive), so each block is its own transfer.
    pairs = tuple((slot, half - 1 - slot) for slot in range(half))
    copier.wait_for_loads()
    copier.run(KVCopies(gpu_to_cpu=pairs))
    gpu[:half].fill_(2.0)  # this step's forward reuses the stored slots at once
    torch.cuda.synchronize()
    assert bool((cpu[:half] == 1.0).all())
    assert bool((gpu[:half] == 2.0).all())


def test_the_next_forward_reads_the_loads_of_the_step_before():
    gpu, cpu = pools()
    copier = KVCopier(gpu, cpu)
    cpu.fill_(3.0)
    pairs = tuple((slot, NUM_BLOCKS - 1 - slot) for slot in range(NUM_BLOCKS))
    copier.wait_for_loads()
    copier.run(KVCopies(cpu_to_gpu=pairs))
    copier.wait_for_loads()  # the next step, without copies of its own
    total = gpu.float().sum()  # read on the compute stream
    assert total.item() == 3.0 * gpu.numel()


def test_stores_run_before_loads_that_refill_their_slots():
    gpu, cpu = pools()
    copier = KVCopier(gpu, cpu)
    gpu[4].fill_(5.0)
    cpu[0].fill_(6.0)
    copier.run(KVCopies(gpu_to_cpu=((4, 3),), cpu_to_gpu=((0, 4),)))
    copier.wait_for_loads()
    assert gpu[4].float().mean().item() == 6.0
    assert cpu[3].float().mean().item() == 5.0
    torch.cuda.synchronize()
    to_cpu, to_gpu = copier.seconds()
    assert to_cpu > 0 and to_gpu > 0
    assert copier.bytes_to_cpu == copier.bytes_to_gpu == gpu[0].nbytes
