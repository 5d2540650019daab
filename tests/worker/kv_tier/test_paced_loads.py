"""PacedLoads: the chunks of the CPU tier's loads and the bucket that paces them (host only;
the copier's use of it on CUDA is in test_kv_copies_cuda.py)."""

from __future__ import annotations

import pytest

from spillway.worker.kv_tier import paced_loads
from spillway.worker.kv_tier.block_copies import block_runs
from spillway.worker.kv_tier.paced_loads import PacedLoads

MiB = 2**20


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(paced_loads.time, "monotonic", clock)
    return clock


def paced(block_bytes: int, bytes_per_s: float = 26e9, num_layers: int = 1) -> PacedLoads:
    """Loads at the engine's default pace, with its burst on the H200 (worker/driver/timing.py)."""
    return PacedLoads(block_bytes, bytes_per_s, burst_s=0.01, num_layers=num_layers)


def pairs(count: int, first: int = 0) -> tuple[tuple[int, int], ...]:
    return tuple((first + i, first + i) for i in range(count))


def test_a_batch_is_cut_into_chunks_and_only_its_last_names_the_batch(clock):
    loads = paced(16 * MiB)  # 4 blocks a chunk
    loads.add(pairs(10), "ready", None, batch=7)
    loads.add(pairs(2, first=10), "ready-2", "stored", batch=8)
    assert len(loads) == 4
    assert loads.pending_bytes == 12 * 16 * MiB
    chunks = loads.take(pace=False)
    assert [len(chunk.pairs) for chunk in chunks] == [4, 4, 2, 2]
    assert [chunk.batch for chunk in chunks] == [0, 0, 7, 8]
    assert [pair for chunk in chunks[:3] for pair in chunk.pairs] == list(pairs(10))
    assert (chunks[3].ready, chunks[3].after) == ("ready-2", "stored")
    assert len(loads) == 0 and loads.pending_bytes == 0


def test_paced_chunks_go_no_faster_than_the_rate_after_the_first_burst(clock):
    loads = paced(MiB, bytes_per_s=1e9)  # 64 blocks a chunk; the bucket holds one (> 10 ms)
    loads.add(pairs(64 * 20), "ready", None, batch=1)
    assert len(loads.take(pace=True)) == 1  # a full bucket: one chunk at once
    assert loads.take(pace=True) == []  # nothing has accrued
    clock.now += 0.5 * 64 * MiB / 1e9
    assert loads.take(pace=True) == []  # half a chunk's worth
    clock.now += 0.5 * 64 * MiB / 1e9
    assert len(loads.take(pace=True)) == 1
    clock.now += 5 * 64 * MiB / 1e9  # a long step while loads wait: the rate holds over all of it
    assert len(loads.take(pace=True)) == 5
    taken = 7
    assert len(loads.take(pace=False)) == 20 - taken  # unpaced: everything left, at once
    clock.now += 64 * MiB / 1e9
    loads.add(pairs(64, first=2000), "ready", None, batch=2)
    assert len(loads.take(pace=True)) == 1  # the unpaced burst drained the bucket; it refilled since


def test_after_a_quiet_spell_the_first_chunks_go_at_once_up_to_the_burst_only(clock):
    loads = paced(MiB, bytes_per_s=1e9)
    loads.take(pace=True)  # the engine looks while nothing is pending
    clock.now += 10.0
    loads.take(pace=True)
    clock.now += 10.0
    loads.add(pairs(64 * 5), "ready", None, batch=1)
    assert len(loads.take(pace=True)) == 1  # 20 s of quiet: the bucket's one chunk, no more
    clock.now += 64 * MiB / 1e9
    assert len(loads.take(pace=True)) == 1


def test_a_rate_of_zero_never_paces_and_a_negative_one_is_refused(clock):
    loads = paced(MiB, bytes_per_s=0)
    loads.add(pairs(64 * 5), "ready", None, batch=1)
    assert len(loads.take(pace=True)) == 5
    with pytest.raises(ValueError, match="must not be negative"):
        paced(MiB, bytes_per_s=-1)


def test_a_batch_goes_a_group_of_layers_at_a_time_first_layers_first_and_names_each_groups_end(clock):
    # 8 layers of 4 MiB a block: groups of 4 layers (a graph segment), a chunk one group of 4 blocks.
    loads = paced(32 * MiB, num_layers=8)
    loads.add(pairs(6), "ready", None, batch=3)
    chunks = loads.take(pace=False)
    assert [(chunk.first_layer, chunk.num_layers, len(chunk.pairs)) for chunk in chunks] == [
        (first, 4, size) for first in (0, 4) for size in (4, 2)]
    assert [chunk.layers_end for chunk in chunks] == [False, True] * 2
    assert [chunk.batch for chunk in chunks] == [0, 0, 0, 3]
    assert [chunk.nbytes for chunk in chunks] == [64 * MiB, 32 * MiB] * 2
    assert all(chunk.pairs == pairs(6)[:4] for chunk in chunks[::2])
    assert all(chunk.runs == block_runs(chunk.pairs) for chunk in chunks)
    assert chunks[0].runs is chunks[2].runs  # each slice's runs found once for every group


def test_small_layers_go_in_larger_groups_whole_segments_and_scattered_blocks_whole(clock, monkeypatch):
    loads = paced(30 * 12 * 2**10, num_layers=30)  # SmolLM2-135M: 12 KiB a layer
    assert loads.layer_groups(pairs(3)) == [(0, 8), (8, 8), (16, 8), (24, 6)]  # 64 KiB: 6 layers, 2 segments
    loads = paced(7 * 40 * 2**10, num_layers=7)
    assert loads.layer_groups(pairs(3)) == [(0, 4), (4, 3)]
    monkeypatch.setattr(paced_loads, "MAX_SLICE_COPIES", 4)
    scattered = tuple((2 * i, 2 * i) for i in range(3))  # three runs: 6 copies by layer groups
    assert loads.layer_groups(pairs(3)) == [(0, 4), (4, 3)]
    assert loads.layer_groups(scattered) == [(0, 7)]
    loads.add(scattered, "ready", None, batch=1)
    (chunk,) = loads.take(pace=False)
    assert (chunk.first_layer, chunk.num_layers, chunk.layers_end, chunk.batch) == (0, 7, True, 1)
    assert paced(MiB).layer_groups(pairs(2)) == [(0, 1)]  # one layer: whole blocks
    assert paced(4 * MiB, num_layers=4).layer_groups(pairs(2)) == [(0, 4)]  # one segment


def test_a_longer_burst_lets_more_chunks_go_at_once_after_a_quiet_spell(clock):
    for burst_s, at_once in ((0.2, 2), (0.4, 5)):  # 200 and 400 MB of the rate: 2 and 5 chunks of 64 MiB
        loads = PacedLoads(MiB, 1e9, burst_s)
        clock.now += 10.0
        loads.add(pairs(64 * 8), "ready", None, batch=1)
        assert len(loads.take(pace=True)) == at_once
