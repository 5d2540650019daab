"""Captured steps by bucket (`StepGraphs`: worker/runner/cuda_graphs.py says which), each a CUDA graph
or, for prefill steps, a graph per segment of layers, so that a step queued before its KV has
landed from the CPU tier waits for each segment's layers alone (worker/kv_tier/copier.py: loads
land a group of layers at a time, first layers first).

A forward inside one graph cannot wait for an event recorded outside it, and running the step
eagerly instead took the H200's host 23-29 ms to launch for Qwen3-8B (tools/bench/tier/overlap.py:
longer than a 10k-token prefix's ~27 ms load, docs/performance.md). So the prefill graphs and
their cascade twins are captured as a graph per segment of layers (`segment_size`; the
embedding goes with the first, the final norm and the logits with the last), and a step
replays them in order: as one graph, a few host microseconds a segment more; planned before
the landing, each segment after the event of its last layer, so the step ends about one
segment's compute after the last layer lands.

    capture:  begin ─ embed, layers 0-3 ─ end/begin ─ layers 4-7 ─ ... ─ layers 32-35, logits ─ end
    replay:   [wait layer 3] graph 0 ─ [wait layer 7] graph 1 ─ ... ─ [wait layer 35] graph 8

The segments share the step's memory pool; what one segment hands the next (the hidden states
and the residual) stays alive while the bucket's segments are captured, and a step replays all
of one bucket's segments before any other graph, so no later capture's reuse of that memory is
ever read in between.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Sequence

import torch

logger = logging.getLogger(__name__)

# A step ends about one segment's compute after its last layer lands, and each segment's replay
# costs a few host microseconds more: with Qwen3-8B's 36 layers in 9 segments the convoy's step
# computes ~1.3 ms after the landing, and its 9 replays take 1.028x one graph's time
# (docs/performance.md, bench_landing). Fewer than MIN_LAYERS_PER_SEGMENT a segment would only
# add replays (and the loads' pitched copies, a group of whole segments each:
# worker/kv_tier/paced_loads.py) to a small model's step, whose tail after the landing is short.
MAX_SEGMENTS = 9
MIN_LAYERS_PER_SEGMENT = 4


def segment_size(num_layers: int) -> int:
    """The layers of each segment (the last may have fewer) of a model of `num_layers`."""
    return max(MIN_LAYERS_PER_SEGMENT, -(-num_layers // MAX_SEGMENTS))


def segment_starts(num_layers: int, layers_per_segment: int | None = None) -> list[int]:
    """The first layer of each segment (of `segment_size(num_layers)` layers by default)."""
    return list(range(0, num_layers, layers_per_segment or segment_size(num_layers)))


class _NoWait:
    def wait(self) -> None:
        pass


class _SegmentBoundary:
    """Stands in for a layer's landing event while a step is captured: before a segment's first
    layer it ends the graph being captured and begins the next."""

    def __init__(self, capture: SegmentCapture) -> None:
        self.capture = capture

    def wait(self) -> None:
        self.capture.next_segment()


class SegmentCapture:
    """Captures one step, `step(layer_ready)`, as a graph per segment into `pool`, on the
    current stream (a side stream, as any capture)."""

    def __init__(self, pool, starts: Sequence[int], num_layers: int) -> None:
        self.pool, self.starts, self.num_layers = pool, list(starts), num_layers
        self.graphs: list[torch.cuda.CUDAGraph] = []

    def next_segment(self) -> None:
        if self.graphs:
            self.graphs[-1].capture_end()
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self.pool)
        self.graphs.append(graph)

    def run(self, step: Callable[[Sequence], torch.Tensor]) -> tuple[list[torch.cuda.CUDAGraph], torch.Tensor]:
        """The segments' graphs and the step's output (written by the last one)."""
        boundaries = set(self.starts[1:])
        marks = [_SegmentBoundary(self) if layer in boundaries else _NoWait() for layer in range(self.num_layers)]
        self.next_segment()
        output = step(marks)
        self.graphs[-1].capture_end()
        assert len(self.graphs) == len(self.starts), "the step's layers did not reach every segment"
        return self.graphs, output


def replay_segments(graphs: Sequence[torch.cuda.CUDAGraph], starts: Sequence[int], num_layers: int,
                    layer_ready: Sequence | None = None) -> None:
    """Replay a step's segments in order on the current stream; with `layer_ready` (an event per
    layer), each after the event of its last layer."""
    for index, graph in enumerate(graphs):
        if layer_ready is not None:
            end = starts[index + 1] if index + 1 < len(starts) else num_layers
            layer_ready[end - 1].wait()
        graph.replay()


class StepGraphs:
    """Captured steps by bucket; `replay(bucket)` returns that graph's logits buffer."""

    def __init__(self, buckets: list[int], device: torch.device, kind: str = "decode",
                 num_layers: int | None = None) -> None:
        self.buckets = sorted(buckets)
        self.device = device
        self.kind = kind
        self.max_bucket = self.buckets[-1]
        # `num_layers`: each step a graph per segment of layers (`segment_size`, module doc)
        self.num_layers = num_layers
        self.segment_starts = segment_starts(num_layers) if num_layers else None
        self._graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self._outputs: dict[int, torch.Tensor] = {}

    def bucket_for(self, size: int) -> int:
        """The smallest bucket >= size; size must be <= `max_bucket`."""
        return self.buckets[bisect.bisect_left(self.buckets, size)]

    @torch.inference_mode()
    def capture(self, step_for: Callable[[int], Callable[[], torch.Tensor]],
                pad: Callable[[int], None], pool=None) -> None:
        """Capture `step_for(bucket)()` for every bucket over inputs that `pad(bucket)` fills,
        into the memory `pool` (a new one when None)."""
        started = time.perf_counter()
        pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        for bucket in reversed(self.buckets):
            step = step_for(bucket)
            pad(bucket)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                step()  # compiles and autotunes kernels, creates library handles
            torch.cuda.current_stream(self.device).wait_stream(stream)
            if self.segment_starts is None:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self._outputs[bucket] = step()
                self._graphs[bucket] = [graph]
            else:
                with torch.cuda.stream(stream):
                    capture = SegmentCapture(pool, self.segment_starts, self.num_layers)
                    self._graphs[bucket], self._outputs[bucket] = capture.run(step)
        torch.cuda.synchronize(self.device)
        logger.info("captured %s graphs for buckets %s in %.1f s", self.kind, self.buckets,
                    time.perf_counter() - started)

    def replay(self, bucket: int, layer_ready: Sequence | None = None) -> torch.Tensor:
        """`layer_ready`: an event per layer that the step waits for (segmented graphs only)."""
        if self.segment_starts is None:
            assert layer_ready is None, "a graph of one segment cannot wait for its layers"
            self._graphs[bucket][0].replay()
        else:
            replay_segments(self._graphs[bucket], self.segment_starts, self.num_layers, layer_ready)
        return self._outputs[bucket]
