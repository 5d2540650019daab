"""Where the time of a decode step goes: device time by kernel of a batch-1 step, and a full-
batch step taken apart (host work, its graph alone, the kernels of the graph)."""

from __future__ import annotations

import time

import torch

from tools.bench_ceilings import bench_ms


def kernel_profile(runner, steps: int) -> str:
    """Device time by kernel over `steps` eager batch-1 decode forwards (what a graph replays)."""
    from torch.profiler import ProfilerActivity, profile

    from spillway.worker.model_runner import ChunkInput

    chunk = ChunkInput([1000], 300, list(range(-(-301 // runner.block_size))))

    def eager_step() -> None:
        runner._forward(runner.inputs.stage([chunk]))

    with torch.inference_mode():
        eager_step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                eager_step()
            torch.cuda.synchronize()
    events = prof.key_averages()
    total_us = sum(e.device_time_total for e in events) / steps
    table = events.table(sort_by="device_time_total", row_limit=14, max_name_column_width=60)
    return f"{table}\nkernel time per step: {total_us / 1e3:.3f} ms ({sum(e.count for e in events) // steps} kernels)"


def run_step_profile(args, prompts: list[list[int]]) -> None:
    """Where a full-batch decode step's time goes: Engine.step() wall time against its decode
    graph's replay alone (the rest is host work the GPU waits for), the host's functions, and
    the kernels of the replay."""
    import cProfile
    import pstats

    from torch.profiler import ProfilerActivity, profile

    from spillway.protocol.messages import Generate, SamplingParams
    from spillway.worker.config import WorkerConfig
    from spillway.worker.engine import Engine

    engine = Engine(WorkerConfig(model="qwen3-8b", load_format="dummy", dtype="bfloat16", device="cuda",
                                 kv_cache_dtype=args.kv_cache_dtype,
                                 max_model_len=args.input_len + args.output_len + 16,
                                 max_num_seqs=args.max_num_seqs, gpu_memory_utilization=0.9))
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    batch = prompts[: args.max_num_seqs]
    for i, prompt in enumerate(batch):
        engine.add_request(Generate(request_id=f"p{i}", prompt_token_ids=prompt, block_hashes=[], params=params))
    while engine.scheduler.num_waiting or any(r.num_output_tokens == 0 for r in engine.scheduler.running):
        engine.step()
    for _ in range(5):
        engine.step()
    torch.cuda.synchronize()
    steps = 30
    started = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    step_ms = (time.perf_counter() - started) / steps * 1e3
    bucket = engine.runner.graphs.bucket_for(len(batch))
    replay_ms = bench_ms(lambda: engine.runner.graphs.replay(bucket), warmup=20, rep=200)
    print(f"decode step at batch {len(batch)} (bucket {bucket}, context ~{args.input_len + 40}, "
          f"{args.kv_cache_dtype} KV cache): "
          f"Engine.step {step_ms:.2f} ms, graph replay alone {replay_ms:.2f} ms, "
          f"host work the GPU waits for {step_ms - replay_ms:.2f} ms")
    host = cProfile.Profile()
    host.enable()
    for _ in range(10):
        engine.step()
    host.disable()
    pstats.Stats(host).sort_stats("tottime").print_stats(15)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            engine.runner.graphs.replay(bucket)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="device_time_total", row_limit=12, max_name_column_width=60))
