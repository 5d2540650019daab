"""The CPU tier's loads, queued no faster than a set rate while other requests compute.

A load writes HBM, and a decode step running beside it slows down about linearly with the
load's rate: on an H200, a 64 x 2,048-token decode step took 1.044x its time alone beside loads
at full speed (~54 GB/s), 1.032x at 40 GB/s, 1.019x at 24 and 1.010x at 12 (docs/performance.md;
stores, which read HBM, cost it 1.009x at full speed). So while other requests compute, the
copier queues a step's loads in chunks of about CHUNK_BYTES, on average no faster than
`bytes_per_s`: a token bucket on the host clock, topped up each time the engine looks (every
step, and every poll while requests wait for their loads). While loads are pending the bucket
fills without a bound, so a step longer than usual (a long prefill) costs them no rate: what
accrued during it goes when it ends. While none are pending it fills to `burst_s` of the rate
at most: the first chunks after a quiet spell go at once. While nothing computes (every request
waits for loads) or a step must wait for the loads, what is pending is queued at once. Loads still land in order (one stream), a batch's landing event after
its last chunk.

A batch is queued a group of layers at a time, the first layers first (every block's slice of
layers 0..k, then k+1..2k, ...: worker/kv_tier/block_copies.py `copy_layers`), so that a forward queued
behind the loads can start on its first layers while the last ones still arrive
(worker/kv_tier/copier.py). A group is a whole number of the step graphs' segments (4 layers of
an 8B model, worker/kv_tier/step_graphs.py) whose slice of a block is at least MIN_SLICE_BYTES: the graphs wait a
segment at a time anyway, and with a group a layer the step that queued a 10k-token prefix's
loads took 4-8 ms more host time on the H200's host (36 pitched copies of 626 rows; whether
the driver's work per row or the copier's per chunk was not measured). A batch whose blocks
lie in so many runs that it would take more than MAX_SLICE_COPIES transfers goes in whole
blocks instead.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from spillway.worker.kv_tier.block_copies import block_runs
from spillway.worker.kv_tier.step_graphs import segment_size

CHUNK_BYTES = 64 * 2**20  # ~1.2 ms of copy at full speed
MIN_SLICE_BYTES = 64 * 2**10  # a pitched copy's rows at least: one layer of an 8B model's block
MAX_SLICE_COPIES = 1024  # ~5 ms of host time at ~5 us a launch


@dataclass(slots=True)
class LoadChunk:
    """Blocks of one load batch to copy CPU -> GPU, after the events its step set."""

    pairs: Sequence[tuple[int, int]]  # (CPU slot, GPU slot)
    ready: object  # an event after the compute queued before its step's forward
    after: object | None  # the step's stores, where a load refills a GPU slot they read
    batch: int  # its load batch, on the batch's last chunk; 0 on the others
    first_layer: int  # the blocks' layers it copies: [first_layer, first_layer + num_layers)
    num_layers: int
    layers_end: bool  # the last chunk of its layers in its batch: they have all landed after it
    nbytes: int
    runs: list[tuple[int, int, int]]  # `block_runs(pairs)`: a copy each (of its layers)


class PacedLoads:
    """Loads planned and not yet queued on the load stream, in order, and the bucket that
    says how many bytes of them may go now."""

    def __init__(self, block_bytes: int, bytes_per_s: float, burst_s: float, num_layers: int = 1) -> None:
        """`bytes_per_s`: the pace (`WorkerConfig.kv_load_gb_s`), 0 for never paced; `burst_s`:
        the most seconds of it a quiet spell saves up (worker/driver/timing.py)."""
        if bytes_per_s < 0:
            raise ValueError(f"a load rate must not be negative, got {bytes_per_s}")
        self.block_bytes = block_bytes
        self.num_layers = num_layers
        # Whole segments of the step's graphs (worker/kv_tier/step_graphs.py), at least MIN_SLICE_BYTES
        layer_bytes = block_bytes // num_layers
        segment = segment_size(num_layers)
        group = max(segment, -(-MIN_SLICE_BYTES // layer_bytes))
        self.layers_per_group = min(num_layers, -(-group // segment) * segment)
        self.bytes_per_s = bytes_per_s  # 0: never paced
        self.chunk_blocks = max(1, CHUNK_BYTES // block_bytes)
        self._capacity = max(bytes_per_s * burst_s, self.chunk_blocks * block_bytes)
        self._bucket = self._capacity
        self._filled_at = time.monotonic()
        self._pending: deque[LoadChunk] = deque()

    def __len__(self) -> int:
        """Chunks not queued yet."""
        return len(self._pending)

    @property
    def pending_bytes(self) -> int:
        return sum(chunk.nbytes for chunk in self._pending)

    def add(self, pairs: Sequence[tuple[int, int]], ready: object, after: object | None, batch: int) -> None:
        """One load batch's copies, cut into chunks behind those pending: a group of layers
        after another (module doc), each in chunks of about CHUNK_BYTES."""
        if not self._pending:
            self._refill(bound=True)  # the quiet spell since the last chunk went
        groups = self.layer_groups(pairs)
        runs_of: dict[tuple[int, int], list[tuple[int, int, int]]] = {}  # the groups cut the same slices
        for index, (first, count) in enumerate(groups):
            slice_bytes = self.block_bytes // self.num_layers * count
            step = max(1, CHUNK_BYTES // slice_bytes)
            for start in range(0, len(pairs), step):
                group_end = start + step >= len(pairs)
                last = group_end and index == len(groups) - 1
                chunk_pairs = pairs[start:start + step]
                if (start, step) not in runs_of:
                    runs_of[(start, step)] = block_runs(chunk_pairs)
                self._pending.append(LoadChunk(chunk_pairs, ready, after, batch if last else 0, first, count,
                                               group_end, len(chunk_pairs) * slice_bytes, runs_of[(start, step)]))

    def layer_groups(self, pairs: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
        """(first layer, count) of each group a batch of `pairs` is queued in, in order."""
        size = self.layers_per_group
        if size >= self.num_layers or len(block_runs(pairs)) * -(-self.num_layers // size) > MAX_SLICE_COPIES:
            return [(0, self.num_layers)]
        return [(first, min(size, self.num_layers - first)) for first in range(0, self.num_layers, size)]

    def take(self, pace: bool) -> list[LoadChunk]:
        """The chunks to queue now, in order: all of them unless `pace`, else as many as the
        bucket pays for (the next one waits for the bucket to hold its bytes)."""
        self._refill(bound=False)  # loads have been pending since the last refill
        taken = []
        while self._pending:
            size = self._pending[0].nbytes
            if pace and self.bytes_per_s and size > self._bucket:
                break
            self._bucket = max(0.0, self._bucket - size)
            taken.append(self._pending.popleft())
        return taken

    def _refill(self, bound: bool) -> None:
        now = time.monotonic()
        self._bucket += (now - self._filled_at) * self.bytes_per_s
        if bound:
            self._bucket = min(self._bucket, self._capacity)
        self._filled_at = now
