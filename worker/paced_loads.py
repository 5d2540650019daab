"""The CPU tier's loads, queued no faster than a set rate while other requests compute.

A load writes HBM, and a decode step running beside it slows down about linearly with the
load's rate: on an H200, a 64 x 2,048-token decode step took 1.044x its time alone beside loads
at full speed (~54 GB/s), 1.032x at 40 GB/s, 1.019x at 24 and 1.010x at 12 (docs/performance.md;
stores, which read HBM, cost it 1.009x at full speed). So while other requests compute, the
copier queues a step's loads in chunks of about CHUNK_BYTES, on average no faster than
`bytes_per_s`: a token bucket on the host clock, topped up each time the engine looks (every
step, and every poll while requests wait for their loads). While loads are pending the bucket
fills without a bound, so a step longer than usual (a long prefill) costs them no rate: what
accrued during it goes when it ends. While none are pending it fills to BURST_S of the rate at
most: the first chunks after a quiet spell go at once. While nothing computes (every request
waits for loads) or a step must wait for the loads, what is pending is queued at once. Loads still land in order (one stream), a batch's landing event after
its last chunk.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

# ~3% of a decode step beside it, by the figures above (about 0.08% per GB/s). The engine takes
# its rate from WorkerConfig.kv_load_gb_s (SPILLWAY_KV_LOAD_GB_S), whose default is this one.
LOAD_BYTES_PER_S = 32e9
CHUNK_BYTES = 64 * 2**20  # ~1.2 ms of copy at full speed
BURST_S = 0.01  # the most the bucket holds after a quiet spell: loads at full speed for ~6 ms


@dataclass(slots=True)
class LoadChunk:
    """Blocks of one load batch to copy CPU -> GPU, after the events its step set."""

    pairs: Sequence[tuple[int, int]]  # (CPU slot, GPU slot)
    ready: object  # an event after the compute queued before its step's forward
    after: object | None  # the step's stores, where a load refills a GPU slot they read
    batch: int  # its load batch, on the batch's last chunk; 0 on the others


class PacedLoads:
    """Loads planned and not yet queued on the load stream, in order, and the bucket that
    says how many bytes of them may go now."""

    def __init__(self, block_bytes: int, bytes_per_s: float = LOAD_BYTES_PER_S) -> None:
        if bytes_per_s < 0:
            raise ValueError(f"a load rate must not be negative, got {bytes_per_s}")
        self.block_bytes = block_bytes
        self.bytes_per_s = bytes_per_s  # 0: never paced
        self.chunk_blocks = max(1, CHUNK_BYTES // block_bytes)
        self._capacity = max(bytes_per_s * BURST_S, self.chunk_blocks * block_bytes)
        self._bucket = self._capacity
        self._filled_at = time.monotonic()
        self._pending: deque[LoadChunk] = deque()

    def __len__(self) -> int:
        """Chunks not queued yet."""
        return len(self._pending)

    @property
    def pending_bytes(self) -> int:
        return sum(len(chunk.pairs) for chunk in self._pending) * self.block_bytes

    def add(self, pairs: Sequence[tuple[int, int]], ready: object, after: object | None, batch: int) -> None:
        """One load batch's copies, cut into chunks behind those pending."""
        if not self._pending:
            self._refill(bound=True)  # the quiet spell since the last chunk went
        step = self.chunk_blocks
        for start in range(0, len(pairs), step):
            last = start + step >= len(pairs)
            self._pending.append(LoadChunk(pairs[start:start + step], ready, after, batch if last else 0))

    def take(self, pace: bool) -> list[LoadChunk]:
        """The chunks to queue now, in order: all of them unless `pace`, else as many as the
        bucket pays for (the next one waits for the bucket to hold its bytes)."""
        self._refill(bound=False)  # loads have been pending since the last refill
        taken = []
        while self._pending:
            size = len(self._pending[0].pairs) * self.block_bytes
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
