"""A step's CUDA graph cut into segments of layers, so that a step queued before its KV has
landed from the CPU tier waits for each segment's layers alone (worker/kv_copies.py: loads
land a group of layers at a time, first layers first).

A forward inside one graph cannot wait for an event recorded outside it, and running the step
eagerly instead costs the host ~1.1-1.5 ms a layer on the H200's host for Qwen3-8B (the
launches of 36 layers outlast a 10k-token prefix's ~27 ms load: docs/performance.md). So the
prefill graphs and their cascade twins are captured as a graph per LAYERS_PER_SEGMENT layers
(the embedding goes with the first, the final norm and the logits with the last), and a step
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

from collections.abc import Callable, Sequence

import torch

LAYERS_PER_SEGMENT = 4  # Qwen3-8B: 9 segments; the convoy's step computes ~1.3 ms after its landing


def segment_starts(num_layers: int, layers_per_segment: int = LAYERS_PER_SEGMENT) -> list[int]:
    """The first layer of each segment."""
    return list(range(0, num_layers, layers_per_segment))


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
