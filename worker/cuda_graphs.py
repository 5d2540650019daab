"""CUDA graphs of the decode step, one per batch-size bucket.

A decode step launches a few hundred small kernels; replaying them as one graph removes the
Python and launch cost that would otherwise bound small models. A batch of n sequences runs
the graph of the smallest bucket >= n, its rows past n padded (token 0, slot -1, context
length 0): the KV write skips them and attention gives them zeros, so they never touch a
real sequence, and their logits are dropped.

    buckets 1, 2, 4, 8, 16, 24, ... below max_num_seqs, and max_num_seqs itself

Graphs are captured largest first and share one memory pool: only one replays at a time,
and its logits are consumed (sampled) before the next replay.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)


def decode_buckets(max_batch_size: int) -> list[int]:
    """1, 2, 4, then every multiple of 8 below `max_batch_size`, then `max_batch_size` itself.

    Steps of 8 keep the padding small where it costs: at large batches the matrix products
    are compute-bound, so a batch of 200 in a bucket of 256 would do 28% more work.
    """
    assert max_batch_size >= 1
    sizes = [1, 2, 4, *range(8, max_batch_size, 8)]
    return [size for size in sizes if size < max_batch_size] + [max_batch_size]


class DecodeGraphs:
    """Captured decode steps by bucket; `replay(bucket)` returns that graph's logits buffer."""

    def __init__(self, buckets: list[int], device: torch.device) -> None:
        self.buckets = sorted(buckets)
        self.device = device
        self.max_batch_size = self.buckets[-1]
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}

    def bucket_for(self, batch_size: int) -> int:
        return self.buckets[bisect.bisect_left(self.buckets, batch_size)]

    @torch.inference_mode()
    def capture(self, step_for: Callable[[int], Callable[[], torch.Tensor]],
                pad: Callable[[int], None]) -> None:
        """Capture `step_for(bucket)()` for every bucket over inputs that `pad(bucket)` fills."""
        started = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        for bucket in reversed(self.buckets):
            step = step_for(bucket)
            pad(bucket)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                step()  # compiles and autotunes kernels, creates library handles
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                self._outputs[bucket] = step()
            self._graphs[bucket] = graph
        torch.cuda.synchronize(self.device)
        logger.info("captured decode graphs for batch sizes %s in %.1f s", self.buckets,
                    time.perf_counter() - started)

    def replay(self, bucket: int) -> torch.Tensor:
        self._graphs[bucket].replay()
        return self._outputs[bucket]
