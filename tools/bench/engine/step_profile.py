"""Where the time of a step goes: device time by kernel of a batch-1 decode step, the mixed
steps that prefill a full batch (their rate, the kernels of one), and a full-batch decode step
taken apart (host work, its graph alone, the kernels of the graph)."""

from __future__ import annotations

import gc
import time

from spillway.tools.bench.ceilings import bench_ms


def kernel_profile(runner, steps: int) -> str:
    """Device time by kernel over `steps` eager batch-1 decode forwards (what a graph replays)."""
    import torch

    from torch.profiler import ProfilerActivity, profile

    from spillway.worker.runner.model_runner import ChunkInput

    chunk = ChunkInput([1000], 300, list(range(-(-301 // runner.block_size))))

    def eager_step() -> None:  # the runner's eager forward, through its public parts: no graph replays
        layout = runner.inputs.stage([chunk])
        metadata = runner.backend.metadata_for(layout)
        hidden = runner.model(layout.input_ids, layout.positions, runner.kv_cache, runner.backend, metadata, None)
        runner.model.compute_logits(hidden[layout.last_rows])

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


def step_kernels(engine) -> tuple[str, float, int]:
    """One Engine.step() under the profiler: its kernels' table, their device time in ms, and
    how many ran."""
    import torch

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    table = events.table(sort_by="device_time_total", row_limit=15, max_name_column_width=60)
    return table, sum(e.device_time_total for e in events) / 1e3, sum(e.count for e in events)


def active_expert_params(model) -> float:
    """Parameters a token runs in the mixture-of-experts layers: its router's, and top_k of
    num_experts of the stacked experts' (0 for a dense model)."""
    from spillway.worker.models.sparse_moe import SparseMoeBlock

    total = 0.0
    for block in (m for m in model.modules() if isinstance(m, SparseMoeBlock)):
        moe = block.gate.moe
        stacked = block.experts.gate_up_proj.numel() + block.experts.down_proj.numel()
        total += block.gate.weight.numel() + stacked * moe.top_k / moe.num_experts
    return total


def prefill_phase(engine, num_requests: int) -> None:
    """Step until every request has its first token; print the rate of those mixed steps (the
    decodes of the requests already prefilled beside prefill chunks, up to
    max_num_batched_tokens) and the device time by kernel of one of them, the first with more
    than a third of the requests decoding (left out of the rate: the profiler slows it). The
    slowest step shows a one-off cost, such as a kernel compiled for a new shape."""
    import torch

    scheduler, plans = engine.scheduler, []  # the plans of Engine.step, for their tokens

    def is_decode(chunk) -> bool:
        return chunk.num_tokens == 1 and chunk.start >= chunk.request.num_prompt_tokens

    profiled = None
    profiled_s = slowest_s = 0.0
    torch.cuda.synchronize()
    started = time.perf_counter()
    while scheduler.num_waiting or any(r.num_output_tokens == 0 for r in scheduler.running):
        if profiled is None and sum(r.num_output_tokens > 0 for r in scheduler.running) > num_requests // 3:
            torch.cuda.synchronize()
            paused = time.perf_counter()
            table, kernel_ms, num_kernels = step_kernels(engine)
            gc.collect()  # the profiler's reference cycles, now: collected later, they stall a timed step
            profiled = engine.last_plan
            profiled_s = time.perf_counter() - paused
        else:
            begun = time.perf_counter()
            engine.step()  # a mixed step returns once its tokens are read: its work is done
            slowest_s = max(slowest_s, time.perf_counter() - begun)
            plans.append(engine.last_plan)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - started - profiled_s
    model = engine.runner.model
    lm_head = model.lm_head.weight.numel()
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear)) - lm_head \
        + active_expert_params(model)
    tokens = sum(plan.num_batched_tokens for plan in plans)
    decode = sum(is_decode(chunk) for plan in plans for chunk in plan.chunks)
    rows = sum(len(plan.chunks) for plan in plans)  # the runner's logits: each chunk's last token
    flops = 2 * (linear * tokens + lm_head * rows)
    print(f"prefill phase of {num_requests} requests, steps of up to {engine.max_num_batched_tokens} tokens "
          f"(the profiled step left out): {len(plans)} steps, {tokens:,} tokens ({tokens - decode:,} prefill, "
          f"{decode:,} decode), {elapsed / len(plans) * 1e3:.1f} ms per step (slowest {slowest_s * 1e3:.1f}), "
          f"{flops / elapsed / 1e12:.1f} TFLOP/s in the linear layers (2 x {linear / 1e9:.2f}B weights per token, "
          f"lm_head's {lm_head / 1e9:.2f}B on each chunk's last token only, {rows:,} rows; attention not counted)")
    if profiled is None:
        return  # every request was prefilled before a third of them decoded
    decode_rows = sum(map(is_decode, profiled.chunks))
    print(table)
    print(f"mixed step with {decode_rows} decode rows and {profiled.num_batched_tokens - decode_rows:,} prefill "
          f"tokens ({len(profiled.chunks) - decode_rows} chunks): kernel time {kernel_ms:.2f} ms "
          f"({num_kernels} kernels)")


def run_step_profile(args, prompts: list[list[int]]) -> None:
    """The mixed steps that prefill a full batch (`prefill_phase`), then where a full-batch
    decode step's time goes: Engine.step() wall time against its decode graph's replay alone
    (the rest is host work the GPU waits for), the host's functions, and the kernels of the
    replay."""
    import torch

    import cProfile
    import pstats

    from torch.profiler import ProfilerActivity, profile

    from spillway.protocol.messages import Generate, SamplingParams
    from spillway.protocol.local.envs import worker_config_from_env
    from spillway.worker.driver.engine import Engine

    engine = Engine(worker_config_from_env(model=args.throughput_model, load_format="dummy", dtype="bfloat16", device="cuda",
                                           kv_cache_dtype=args.kv_cache_dtype,
                                           max_model_len=args.input_len + args.output_len + 16,
                                           max_num_seqs=args.max_num_seqs, gpu_memory_utilization=0.9))
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    batch = prompts[: args.max_num_seqs]
    for i, prompt in enumerate(batch):
        engine.add_request(Generate(request_id=f"p{i}", prompt_token_ids=prompt, block_hashes=[], params=params))
    prefill_phase(engine, len(batch))
    for _ in range(5):
        engine.step()
    torch.cuda.synchronize()
    steps = 30
    started = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    step_ms = (time.perf_counter() - started) / steps * 1e3
    running = len(engine.scheduler.running)  # below the batch where the KV cache holds fewer
    bucket = engine.runner.cuda_graphs.decode.bucket_for(running)
    replay_ms = bench_ms(lambda: engine.runner.cuda_graphs.decode.replay(bucket), warmup=20, rep=200)
    print(f"decode step at batch {running} of {len(batch)} (bucket {bucket}, context ~{args.input_len + 40}, "
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
            engine.runner.cuda_graphs.decode.replay(bucket)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="device_time_total", row_limit=12, max_name_column_width=60))
