"""KVCopier on CUDA: the copy streams' order against compute and against each other (skipped
without a GPU).

The pools are large enough (a few hundred MiB a step) that a copy running unordered beside
the compute stream's writes would read or leave the wrong bytes. Between the two copy streams,
a sleep queued on the store stream makes the stores late: a load that does not wait for them
finishes first."""

from __future__ import annotations

import pytest
import torch

from spillway.worker.kv_tier.host_pool import allocate_cpu_pool
from spillway.worker.kv_tier.copier import KVCopier
from spillway.worker.core.step_plan import KVCopies

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

BLOCK_SHAPE = (8, 2, 16, 8, 128)  # 512 KiB per block in bfloat16
NUM_BLOCKS = 1024
STALL_CYCLES = 200_000_000  # ~0.1 s of the store stream: far longer than any copy here


def copier_of(gpu: torch.Tensor, cpu: torch.Tensor, load_bytes_per_s: float = 26e9) -> KVCopier:
    """A copier paced as the engine's by default, with its burst and speed guess on the H200."""
    return KVCopier(gpu, cpu, load_bytes_per_s, load_burst_s=0.01, load_speed_guess=45e9)


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
    copier = copier_of(gpu, cpu)
    half = NUM_BLOCKS // 2
    torch.cuda._sleep(50_000_000)  # compute is busy when the copies are issued
    gpu[:half].fill_(1.0)  # written by the steps before
    # Scattered pairs (no two consecutive), so each block is its own transfer.
    pairs = tuple((slot, half - 1 - slot) for slot in range(half))
    copier.run(KVCopies(gpu_to_cpu=pairs))
    gpu[:half].fill_(2.0)  # this step's forward reuses the stored slots at once
    torch.cuda.synchronize()
    assert bool((cpu[:half] == 1.0).all())
    assert bool((gpu[:half] == 2.0).all())


def test_each_load_batch_is_reported_once_landed_and_no_forward_waits_for_loads():
    gpu, cpu = pools()
    copier = copier_of(gpu, cpu)
    cpu.fill_(3.0)
    half = NUM_BLOCKS // 2
    copier.run(KVCopies(cpu_to_gpu=tuple((slot, slot) for slot in range(half)), load_batch=1))
    with torch.cuda.stream(copier.load_stream):
        torch.cuda._sleep(STALL_CYCLES)  # batch 2 is late
    copier.run(KVCopies(cpu_to_gpu=tuple((slot, slot) for slot in range(half, NUM_BLOCKS)), load_batch=2))
    forward = torch.cuda.Event()
    forward.record()  # the next step's forward does not wait for the loads
    forward.synchronize()
    assert not copier.load_stream.query()
    while copier.landed_through() < 1:
        pass
    assert copier.landed_through() == 1  # batch 2 still on its way
    total = gpu[:half].float().sum()  # a forward planned after batch 1 was seen to land
    assert total.item() == 3.0 * gpu[:half].numel()
    assert copier.landed_through(wait=True) == 2
    assert bool((gpu[half:] == 3.0).all())


def test_a_step_reusing_a_slot_still_loading_waits_for_the_loads():
    gpu, cpu = pools()
    copier = copier_of(gpu, cpu)
    cpu.fill_(3.0)
    with torch.cuda.stream(copier.load_stream):
        torch.cuda._sleep(STALL_CYCLES)
    copier.run(KVCopies(cpu_to_gpu=tuple((slot, slot) for slot in range(NUM_BLOCKS)), load_batch=1))
    copier.run(KVCopies(wait_for_loads=True))  # its request went: the slots go elsewhere
    gpu.fill_(9.0)  # the forward that reuses them
    torch.cuda.synchronize()
    assert bool((gpu == 9.0).all())


def test_stores_run_before_loads_that_refill_their_slots():
    gpu, cpu = pools()
    copier = copier_of(gpu, cpu)
    gpu[4].fill_(5.0)
    cpu[0].fill_(6.0)
    copier.run(KVCopies(gpu_to_cpu=((4, 3),), cpu_to_gpu=((0, 4),), load_batch=1))
    assert copier.landed_through(wait=True) == 1
    assert gpu[4].float().mean().item() == 6.0
    assert cpu[3].float().mean().item() == 5.0
    torch.cuda.synchronize()
    to_cpu, to_gpu = copier.seconds()
    assert to_cpu > 0 and to_gpu > 0
    assert copier.bytes_to_cpu == copier.bytes_to_gpu == gpu[0].nbytes


def test_stores_and_loads_of_disjoint_slots_run_at_once_and_both_land():
    gpu, cpu = pools()
    copier = copier_of(gpu, cpu)
    half = NUM_BLOCKS // 2
    gpu[:half].fill_(7.0)
    cpu[half:].fill_(8.0)
    stores = tuple((slot, slot) for slot in range(half))
    loads = tuple((slot, slot) for slot in range(half, NUM_BLOCKS))
    with torch.cuda.stream(copier.store_stream):
        torch.cuda._sleep(STALL_CYCLES)
    copier.run(KVCopies(gpu_to_cpu=stores, cpu_to_gpu=loads))
    copier.load_stream.synchronize()
    assert not copier.store_stream.query()  # the loads did not wait for the late stores
    assert bool((gpu[half:] == 8.0).all())
    torch.cuda.synchronize()
    assert bool((cpu[:half] == 7.0).all())
    assert bool((gpu[:half] == 7.0).all())
    assert copier.bytes_to_cpu == copier.bytes_to_gpu == half * gpu[0].nbytes
    to_cpu, to_gpu = copier.seconds()
    assert to_cpu > 0 and to_gpu > 0


def test_a_load_into_a_slot_a_late_store_reads_waits_for_it_and_is_timed_alone():
    gpu, cpu = pools()
    copier = copier_of(gpu, cpu)
    gpu[4].fill_(5.0)
    cpu[0].fill_(6.0)
    with torch.cuda.stream(copier.store_stream):
        torch.cuda._sleep(STALL_CYCLES)
    copier.run(KVCopies(gpu_to_cpu=((4, 3),), cpu_to_gpu=((0, 4),)))
    torch.cuda.synchronize()
    assert cpu[3].float().mean().item() == 5.0  # the store read the old bytes
    assert gpu[4].float().mean().item() == 6.0
    to_cpu, to_gpu = copier.seconds()
    # Each direction's events bracket its copies alone: neither the stall nor the wait counts.
    assert 0 < to_cpu < 0.02 and 0 < to_gpu < 0.02


def test_stores_ahead_of_eviction_hold_up_no_forward_until_a_step_reuses_their_slots():
    gpu, cpu = pools()
    copier = copier_of(gpu, cpu)
    half = NUM_BLOCKS // 2
    gpu[:half].fill_(1.0)  # cached blocks
    with torch.cuda.stream(copier.store_stream):
        torch.cuda._sleep(STALL_CYCLES)  # the ahead stores run late
    copier.run(KVCopies(ahead_to_cpu=tuple((slot, half - 1 - slot) for slot in range(half))))
    marker = torch.cuda.Event()
    marker.record()  # this step's forward goes on without them
    marker.synchronize()
    assert not copier.ahead_stored()
    # The next step reuses their slots: its forward and a load into them wait for the stores.
    cpu[half:].fill_(4.0)
    copier.run(KVCopies(cpu_to_gpu=tuple((half + slot, slot) for slot in range(half // 2)), wait_for_ahead=True))
    gpu[half // 2:half].fill_(2.0)  # the forward writes the rest of them
    torch.cuda.synchronize()
    assert copier.ahead_stored()
    assert bool((cpu[:half] == 1.0).all())
    assert bool((gpu[:half // 2] == 4.0).all()) and bool((gpu[half // 2:half] == 2.0).all())


def test_store_batches_are_reported_in_host_memory_only_once_their_stores_ran():
    gpu, cpu = pools()
    copier = copier_of(gpu, cpu)
    gpu[:4].fill_(1.0)
    with torch.cuda.stream(copier.store_stream):
        torch.cuda._sleep(STALL_CYCLES)  # the stores run late
    copier.run(KVCopies(gpu_to_cpu=((0, 0), (1, 1)), store_batch=1))  # at an eviction
    copier.run(KVCopies(ahead_to_cpu=((2, 2), (3, 3)), store_batch=2))  # ahead of one
    assert copier.stored_through() == 0  # what those CPU slots hold is not known yet
    torch.cuda.synchronize()
    assert copier.stored_through() == 2
    assert bool((cpu[:4] == 1.0).all())


def test_paced_loads_wait_to_be_pumped_and_land_after_the_compute_before_their_step():
    gpu, cpu = pools()
    # Groups of 4 layers (256 KiB of a block): a chunk is 256 blocks' group; one goes at once.
    copier = copier_of(gpu, cpu, load_bytes_per_s=1e9)
    cpu.fill_(3.0)
    torch.cuda._sleep(50_000_000)  # compute is busy when the loads are planned
    gpu.fill_(1.0)  # written by the steps before: the loads must land after it
    copier.run(KVCopies(cpu_to_gpu=tuple((slot, slot) for slot in range(NUM_BLOCKS)), load_batch=1), pace=True)
    assert len(copier.pending_loads) == 2 * NUM_BLOCKS // 256 - 1
    torch.cuda.synchronize()
    assert copier.landed_through() == 0  # its last chunk is not even queued
    assert bool((gpu[:256, :4] == 3.0).all()) and bool((gpu[256:, :4] == 1.0).all()) and bool((gpu[:, 4:] == 1.0).all())
    copier.pump(pace=False)
    assert not copier.pending_loads
    assert copier.landed_through(wait=True) == 1
    assert bool((gpu == 3.0).all())


def test_a_step_reusing_a_slot_still_loading_waits_for_the_paced_loads_too():
    gpu, cpu = pools()
    copier = copier_of(gpu, cpu, load_bytes_per_s=1e9)
    cpu.fill_(3.0)
    copier.run(KVCopies(cpu_to_gpu=tuple((slot, slot) for slot in range(NUM_BLOCKS)), load_batch=1), pace=True)
    assert copier.pending_loads
    copier.run(KVCopies(wait_for_loads=True), pace=True)  # queues them all first, then waits
    assert not copier.pending_loads
    gpu.fill_(9.0)  # the forward that reuses the slots
    torch.cuda.synchronize()
    assert bool((gpu == 9.0).all())
    assert copier.landed_through() == 1


def test_a_forward_planned_before_the_landing_waits_for_each_layer_of_every_load_queued():
    """Two batches, the second late: the events returned are per layer (one per group of 4), and
    each says that layer of both batches has landed while later layers may still be on their way."""
    gpu, cpu = pools()
    copier = copier_of(gpu, cpu)
    for layer in range(BLOCK_SHAPE[0]):
        cpu[:, layer].fill_(10.0 + layer)
    half = NUM_BLOCKS // 2
    copier.run(KVCopies(cpu_to_gpu=tuple((slot, slot) for slot in range(half)), load_batch=1))
    with torch.cuda.stream(copier.load_stream):
        torch.cuda._sleep(STALL_CYCLES)
    # Descending slots: the run a write-back in eviction order makes.
    loads = tuple((slot, slot) for slot in reversed(range(half, NUM_BLOCKS)))
    waits = copier.run(KVCopies(cpu_to_gpu=loads, load_batch=2, wait_for_loads=True, wait_by_layer=True))
    assert waits is not None and len(waits) == BLOCK_SHAPE[0]  # a group of 4 layers: one event each
    assert all(waits[layer] is waits[layer // 4 * 4] for layer in range(BLOCK_SHAPE[0])) and waits[0] is not waits[4]
    sums = []
    for layer, event in enumerate(waits):  # what the forward reads at each layer, in order
        event.wait()
        sums.append(gpu[:, layer].float().sum())
    torch.cuda.synchronize()
    per_layer = gpu[:, 0].numel()
    assert [total.item() for total in sums] == [(10.0 + layer) * per_layer for layer in range(BLOCK_SHAPE[0])]
    assert copier.landed_through() == 2


def test_a_forward_that_only_reuses_a_loading_slot_waits_for_the_loads_as_a_whole():
    gpu, cpu = pools()
    copier = copier_of(gpu, cpu)
    copier.run(KVCopies(cpu_to_gpu=((0, 0),), load_batch=1))
    assert copier.run(KVCopies(wait_for_loads=True)) is None


def test_a_batch_in_whole_blocks_gives_no_layer_to_wait_for_and_the_forward_waits_for_it_all(monkeypatch):
    from spillway.worker.kv_tier import paced_loads

    monkeypatch.setattr(paced_loads, "MAX_SLICE_COPIES", 2)  # two scattered blocks: 4 copies by layer group
    gpu, cpu = pools()
    copier = copier_of(gpu, cpu)
    copier.run(KVCopies(cpu_to_gpu=((0, 0), (1, 1)), load_batch=1))
    assert copier.lands_by_layer()
    cpu[4].fill_(5.0)
    with torch.cuda.stream(copier.load_stream):
        torch.cuda._sleep(STALL_CYCLES)  # the whole batch is late
    copier.run(KVCopies(cpu_to_gpu=((2, 2), (4, 6)), load_batch=2))
    assert not copier.lands_by_layer()
    assert copier.run(KVCopies(wait_for_loads=True, wait_by_layer=True)) is None  # queued on compute instead
    assert gpu[6].float().mean().item() == 5.0  # read after that wait
