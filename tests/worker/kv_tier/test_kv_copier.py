"""The CPU tier's copier as the engine builds it: block copies in runs, the load pace it takes
from the config, the order of a step's loads and stores, and `time_copies` (the engine's own
outputs through the tier: test_cpu_tier_engine.py)."""

from __future__ import annotations

import pytest
import torch
from tests.worker.kv_tier.test_cpu_tier_engine import DEVICES, checkpoints, engine_for, model_dir  # noqa: F401 (fixtures)

from spillway.protocol.config import WorkerConfig
from spillway.worker.driver.engine import Engine
from spillway.worker.core.step_plan import KVCopies
from spillway.worker.kv_tier.block_copies import block_runs, copy_blocks
from spillway.worker.kv_tier.copier import KVCopier


def test_the_copier_paces_loads_at_the_configured_rate(model_dir):
    engine = Engine(WorkerConfig(model=str(model_dir), device="cpu", dtype="float32", max_num_seqs=4,
                                 num_gpu_blocks_override=4, num_cpu_blocks_override=4, kv_load_gb_s=12.5))
    assert engine.executor.kv_copier.pending_loads.bytes_per_s == 12.5e9
    assert engine_for(model_dir, 4).executor.kv_copier.pending_loads.bytes_per_s == 26e9


def test_copy_blocks_copies_runs_of_slots_and_single_ones():
    src = torch.arange(6 * 3, dtype=torch.float32).reshape(6, 3)
    dst = torch.zeros(5, 3)
    copy_blocks(src, dst, [(0, 1), (1, 2), (2, 3), (5, 0)])
    assert dst.tolist() == [src[5].tolist(), src[0].tolist(), src[1].tolist(), src[2].tolist(), [0, 0, 0]]


def test_runs_go_up_or_down_on_both_sides_at_once():
    assert block_runs([]) == []
    assert block_runs([(0, 1), (1, 2), (2, 3), (5, 0)]) == [(0, 1, 3), (5, 0, 1)]
    assert block_runs([(7, 3), (6, 2), (5, 1), (9, 9)]) == [(5, 1, 3), (9, 9, 1)]  # down: one run
    assert block_runs([(0, 3), (1, 2)]) == [(0, 3, 1), (1, 2, 1)]  # opposite ways: a copy each
    src = torch.arange(8 * 2, dtype=torch.float32).reshape(8, 2)
    dst = torch.zeros(8, 2)
    copy_blocks(src, dst, [(7, 3), (6, 2), (5, 1), (0, 4), (1, 5)])
    assert dst.tolist() == [[0, 0], src[5].tolist(), src[6].tolist(), src[7].tolist(), src[0].tolist(),
                            src[1].tolist(), [0, 0], [0, 0]]


@pytest.mark.parametrize("device", DEVICES)
def test_time_copies_moves_blocks_both_ways_for_a_benchmark(model_dir, device):
    engine = Engine(WorkerConfig(model=str(model_dir), device=device, dtype="float32", max_num_seqs=4,
                                 num_gpu_blocks_override=8, num_cpu_blocks_override=8))
    copier = engine.executor.kv_copier
    pool = engine.runner.kv_cache
    pool.copy_(torch.arange(pool.numel(), dtype=pool.dtype).reshape(pool.shape))
    original = pool.clone()
    to_cpu, to_gpu = copier.time_copies(4, scattered=True)
    assert to_cpu > 0 and to_gpu > 0
    assert torch.equal(copier.cpu_pool[0:8:2], original[0:8:2].cpu())
    assert torch.equal(pool, original)
    assert copier.bytes_to_cpu == copier.bytes_to_gpu == 4 * pool[0].nbytes
    with pytest.raises(ValueError, match="do not fit"):
        copier.time_copies(5, scattered=True)


def test_on_the_cpu_a_store_batch_is_written_when_run_and_reported_so():
    gpu_pool = torch.arange(4 * 6, dtype=torch.float32).reshape(4, 2, 3)
    cpu_pool = torch.zeros(4, 2, 3)
    copier = KVCopier(gpu_pool, cpu_pool, 0.0, 0.0, load_speed_guess=1e9)
    assert copier.stored_through() == 0
    copier.run(KVCopies(gpu_to_cpu=((2, 0),), store_batch=1))
    assert copier.stored_through() == 1 and torch.equal(cpu_pool[0], gpu_pool[2])
    copier.run(KVCopies(cpu_to_gpu=((0, 3),), load_batch=1))  # no stores: no batch
    assert copier.stored_through() == 1
    copier.run(KVCopies(ahead_to_cpu=((1, 2),), store_batch=2))
    assert copier.stored_through() == 2 and torch.equal(cpu_pool[2], gpu_pool[1])


def test_a_load_waits_for_the_stores_only_when_they_share_a_slot():
    from spillway.worker.kv_tier.copier import _overlap
    from spillway.worker.core.step_plan import KVCopies

    assert not _overlap(KVCopies(gpu_to_cpu=((1, 10),), cpu_to_gpu=((11, 2),)))
    assert _overlap(KVCopies(gpu_to_cpu=((1, 10),), cpu_to_gpu=((11, 1),)))  # refills the stored GPU slot
    assert _overlap(KVCopies(gpu_to_cpu=((1, 10),), cpu_to_gpu=((10, 2),)))  # reads the CPU slot being written
    assert not _overlap(KVCopies(cpu_to_gpu=((10, 2),)))
