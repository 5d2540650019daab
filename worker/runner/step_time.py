"""The model's batch-1 decode step, timed at start-up: the unit the engine's deadlines and
budgets scale with (worker/driver/timing.py).

Where the decode graphs are captured this is their replay alone, as tools/bench/engine/engine.py
reports it beside the decode rate (4.505 ms for Qwen3-8B on the H200); elsewhere an eager step,
whose host time is part of every step there.
"""

from __future__ import annotations

import statistics
import time

import torch

from spillway.worker.runner.model_runner import ChunkInput, ModelRunner


@torch.inference_mode()
def time_decode_step(runner: ModelRunner, repeats: int = 5) -> float:
    """Seconds of one decode step of one token at position 0 (its KV written to the pool's
    first slot, which no request holds yet): the median of `repeats`, after one untimed step.
    Every rank of a tensor-parallel group runs it alike: the step calls collectives."""
    assert runner.kv_cache is not None, "allocate the KV cache first"
    chunks = [ChunkInput([0], 0, [0])]
    runner.execute(chunks)  # stages the inputs a graph replays, and warms caches and clocks
    graphs = runner.cuda_graphs.decode
    if graphs is not None:
        bucket = graphs.bucket_for(1)

        def step() -> None:
            graphs.replay(bucket)
    else:
        def step() -> None:
            runner.execute(chunks)
    times = []
    for _ in range(repeats):
        if runner.device.type == "cuda":  # the device's time, on events, as triton's do_bench takes it
            started, finished = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            started.record()
            step()
            finished.record()
            finished.synchronize()
            times.append(started.elapsed_time(finished) / 1000)
        else:
            started_s = time.perf_counter()
            step()
            times.append(time.perf_counter() - started_s)
    return statistics.median(times)
