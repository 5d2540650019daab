"""A step's graph in segments of layers (worker/kv_tier/step_graphs.py): where the segments start, and
the order of waits and replays (host only, stand-ins for graphs and events; the capture and
replay on a GPU: tests/worker/runner/test_gpu_cascade_graphs.py)."""

from __future__ import annotations

from spillway.worker.kv_tier.step_graphs import replay_segments, segment_size, segment_starts


class Logged:
    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name = log, name

    def wait(self) -> None:
        self.log.append(f"wait {self.name}")

    def replay(self) -> None:
        self.log.append(f"replay {self.name}")


def test_segments_start_every_four_layers_and_the_last_takes_the_rest():
    assert segment_starts(36) == [0, 4, 8, 12, 16, 20, 24, 28, 32]
    assert segment_starts(30) == [0, 4, 8, 12, 16, 20, 24, 28]
    assert segment_starts(3) == [0]
    assert segment_starts(10, layers_per_segment=5) == [0, 5]


def test_a_model_with_more_layers_gets_longer_segments_never_more_than_nine():
    assert [segment_size(layers) for layers in (2, 28, 36, 37, 48, 64, 80, 126)] == [4, 4, 4, 5, 6, 8, 9, 14]
    assert segment_starts(80) == [0, 9, 18, 27, 36, 45, 54, 63, 72]
    assert len(segment_starts(126)) == 9


def test_each_segment_replays_after_the_event_of_its_last_layer_and_without_events_at_once():
    log: list[str] = []
    graphs = [Logged(log, f"g{index}") for index in range(3)]
    events = [Logged(log, f"layer {layer}") for layer in range(10)]
    replay_segments(graphs, [0, 4, 8], 10, events)
    assert log == ["wait layer 3", "replay g0", "wait layer 7", "replay g1", "wait layer 9", "replay g2"]
    log.clear()
    replay_segments(graphs, [0, 4, 8], 10)
    assert log == ["replay g0", "replay g1", "replay g2"]
