"""The rows of tools/bench/tier/kv_offload.py that run a model (dummy weights of a built-in config):
what continuous offload traffic costs a decode step, and reloading a long prefix from the CPU
tier against recomputing it."""

from __future__ import annotations

import math
import random
import time

from spillway.tools.bench.result_rows import Rows, row

TARGET_RELOAD_SPEEDUP = 10.0
TARGET_INTERFERENCE = 1.03  # decode step time beside offload traffic, against alone
ASSUMED_MAX_COPY_BYTES_PER_S = 60e9  # above one direction's ~55 GB/s: traffic sized by it lasts long enough


def make_engine(args, *, max_model_len: int, max_num_seqs: int, num_gpu_blocks: int, num_cpu_blocks: int,
                enforce_eager: bool, max_num_batched_tokens: int | None = None):
    """An engine over `args.model`'s dummy weights, both KV pools fixed (no profiling run)."""
    from spillway.protocol.local.envs import worker_config_from_env
    from spillway.worker.driver.engine import Engine

    return Engine(worker_config_from_env(
        model=args.model, load_format="dummy", dtype="bfloat16", device="cuda", block_size=args.block_size,
        max_model_len=max_model_len, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens, num_gpu_blocks_override=num_gpu_blocks,
        num_cpu_blocks_override=num_cpu_blocks, enforce_eager=enforce_eager))


def run_interference(args, rows: Rows) -> None:
    """Sequence i decodes over GPU slots [i * per_seq, (i + 1) * per_seq); the traffic stores GPU
    slots after those and loads into the ones after those (disjoint: it never touches the step's
    KV). Median of 3 timings of --decode-steps replays each, alone and with traffic."""
    from spillway.worker.runner.model_runner import ChunkInput

    per_seq = math.ceil(args.decode_context / args.block_size)
    decode_blocks, n = args.decode_batch * per_seq, args.blocks
    engine = make_engine(args, max_model_len=args.decode_context, max_num_seqs=args.decode_batch,
                         num_gpu_blocks=decode_blocks + 2 * n, num_cpu_blocks=2 * n, enforce_eager=False)
    runner, copier = engine.runner, engine.executor.kv_copier
    chunks = [ChunkInput([1000 + i], args.decode_context - 1, list(range(i * per_seq, (i + 1) * per_seq)))
              for i in range(args.decode_batch)]
    runner.execute(chunks)  # stages the inputs the decode graph replays, and warms it
    bucket = runner.cuda_graphs.decode.bucket_for(args.decode_batch)
    stores = tuple(zip(range(decode_blocks, decode_blocks + n), range(n)))
    loads = tuple(zip(range(n, 2 * n), range(decode_blocks + n, decode_blocks + 2 * n)))

    def replays() -> None:
        for _ in range(args.decode_steps):
            runner.cuda_graphs.decode.replay(bucket)

    alone = sorted(step_seconds(replays, args.decode_steps) for _ in range(3))[1]
    window_s = 2 * alone * args.decode_steps  # the steps may slow down beside the traffic: room to spare
    rounds = math.ceil(window_s * ASSUMED_MAX_COPY_BYTES_PER_S / (n * copier.block_bytes)) + 1
    # Each direction alone (a tier hit loading; evictions written back), then both at once.
    for label, traffic in (("loads", {"loads": loads}), ("stores", {"stores": stores}),
                           ("stores and loads", {"stores": stores, "loads": loads})):
        seconds, covered, rates = sorted((step_seconds_beside_traffic(replays, args.decode_steps, copier,
                                                                      rounds=rounds, **traffic)
                                          for _ in range(3)), key=lambda timing: timing[0])[1]
        flows = ", ".join(f"{rate / 1e9:.1f} GB/s {way}" for way, rate in rates.items())
        rows.add(row(f"decode step beside {label}", seconds * 1e3, "ms/step", "the step alone", alone * 1e3,
                     seconds / alone, note=f"ratio with / without (lower is better; target <= "
                     f"{TARGET_INTERFERENCE:.2f}); graph replay, batch {args.decode_batch} x {args.decode_context} "
                     f"tokens, {args.model} dummy weights; traffic: {n}-block copies repeated {rounds}x on the "
                     f"copier's streams, {flows} meanwhile; traffic ran through every timed step: {covered}"))
    # The copier's own pacing (worker/kv_tier/paced_loads.py), the engine's way: a step at a time, the
    # host at most two steps ahead, the loads planned again whenever the last batch has landed
    # (and the stores, ahead of eviction as the engine writes them, whenever the last are done).
    stepped_alone = sorted(stepped_seconds(bucket, runner, args.decode_steps)[0] for _ in range(3))[1]
    for label, pace, with_stores in (("a CPU hit's loads at full speed", False, False),
                                     ("a CPU hit's loads paced by the copier", True, False),
                                     ("stores and a CPU hit's loads at full speed", False, True),
                                     ("stores, and a CPU hit's loads paced by the copier", True, True)):
        seconds, rates = sorted(stepped_seconds(bucket, runner, args.decode_steps, copier, loads, pace,
                                                stores if with_stores else ()) for _ in range(3))[1]
        flows = ", ".join(f"{rate / 1e9:.1f} GB/s {way}" for way, rate in rates.items())
        rows.add(row(f"decode step beside {label}", seconds * 1e3, "ms/step", "the step alone",
                     stepped_alone * 1e3, seconds / stepped_alone,
                     note=f"ratio with / without (target <= {TARGET_INTERFERENCE:.2f}); {n}-block loads through "
                     f"KVCopier.run, planned again as each lands, pumped before every step"
                     f"{f' (paced to {copier.pending_loads.bytes_per_s / 1e9:g} GB/s)' if pace else ''}"
                     f"{f'; {n}-block stores ahead of eviction, planned again as each batch is done' if with_stores else ''}"
                     f": {flows} queued while the steps ran; graph replays queued a step at a time, batch "
                     f"{args.decode_batch} x {args.decode_context} tokens, {args.model} dummy weights"))
    for gb_s in args.paced_load_gb_s:  # would loads at a lower rate cost the step less?
        seconds, rate = sorted(step_seconds_beside_paced_loads(replays, args.decode_steps, copier, loads,
                                                               gb_s * 1e9) for _ in range(3))[1]
        rows.add(row(f"decode step beside loads paced to {gb_s:g} GB/s", seconds * 1e3, "ms/step", "the step alone",
                     alone * 1e3, seconds / alone, note=f"ratio with / without; loads of {PACED_CHUNK_BLOCKS} blocks "
                     f"queued by a host thread, each once the one before has landed and no sooner than the rate "
                     f"allows: {rate / 1e9:.1f} GB/s reached while the steps ran; graph replay, batch "
                     f"{args.decode_batch} x {args.decode_context} tokens, {args.model} dummy weights"))


PACED_CHUNK_BLOCKS = 32


def stepped_seconds(bucket: int, runner, num_steps: int, copier=None, loads=(), pace: bool = False,
                    stores=()) -> tuple[float, dict[str, float]]:
    """Seconds per step of `num_steps` graph replays queued one at a time, the host at most two
    steps ahead (as the engine's loop runs); with `copier`, `loads` planned through it as one
    batch again each time the last has landed (`pace`: at the copier's rate, pumped before every
    step), and `stores` as stores ahead of eviction again each time the last are done. Returns the
    seconds and the bytes/s queued each way while the steps ran (loads still pending excluded)."""
    import torch

    from collections import deque

    from spillway.worker.core.step_plan import KVCopies

    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    batch = copier.landed_through(wait=True) if copier is not None else 0
    to_gpu, to_cpu = (copier.bytes_to_gpu, copier.bytes_to_cpu) if copier is not None else (0, 0)
    in_flight = deque()
    started = time.perf_counter()
    start.record()
    for _ in range(num_steps):
        if copier is not None:
            copier.pump(pace)
            load = bool(loads) and copier.landed_through() >= batch
            store = bool(stores) and copier.ahead_stored()
            batch += load
            if load or store:
                copier.run(KVCopies(cpu_to_gpu=loads if load else (), ahead_to_cpu=stores if store else (),
                                    load_batch=batch if load else 0), pace)
        runner.cuda_graphs.decode.replay(bucket)
        stepped = torch.cuda.Event()
        stepped.record()
        in_flight.append(stepped)
        if len(in_flight) > 2:
            in_flight.popleft().synchronize()
    end.record()
    end.synchronize()
    seconds = time.perf_counter() - started
    rates = {}
    if copier is not None:
        if loads:
            rates["to GPU"] = (copier.bytes_to_gpu - to_gpu - copier.pending_loads.pending_bytes) / seconds
        if stores:
            rates["to host"] = (copier.bytes_to_cpu - to_cpu) / seconds
        copier.landed_through(wait=True)
        torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / num_steps, rates


def step_seconds_beside_paced_loads(replays, num_steps: int, copier, loads, rate: float) -> tuple[float, float]:
    """Seconds per step of `replays` while a host thread queues `loads` over and over on the
    copier's load stream, PACED_CHUNK_BLOCKS blocks at a time, each chunk once the one before
    has landed and no sooner than `rate` bytes/s allows; and the bytes/s loaded meanwhile."""
    import torch

    import threading

    from spillway.worker.kv_tier.block_copies import copy_blocks

    chunks = [loads[i:i + PACED_CHUNK_BLOCKS] for i in range(0, len(loads), PACED_CHUNK_BLOCKS)]
    stop, loaded = threading.Event(), [0]

    def load() -> None:
        due = time.perf_counter()
        with torch.cuda.stream(copier.load_stream):
            while not stop.is_set():
                for chunk in chunks:
                    time.sleep(max(0.0, due - time.perf_counter()))
                    if stop.is_set():
                        return
                    copy_blocks(copier.cpu_pool, copier.gpu_pool, chunk)
                    torch.cuda.current_stream().synchronize()
                    loaded[0] += len(chunk) * copier.block_bytes
                    due = max(due + len(chunk) * copier.block_bytes / rate, time.perf_counter())

    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    try:
        time.sleep(0.05)  # under way
        started, loaded_before = time.perf_counter(), loaded[0]
        seconds = step_seconds(replays, num_steps)
        rate_reached = (loaded[0] - loaded_before) / (time.perf_counter() - started)
    finally:
        stop.set()
        thread.join()
    torch.cuda.synchronize()
    return seconds, rate_reached


def step_seconds(replays, num_steps: int) -> float:
    import torch

    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    replays()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / num_steps


def step_seconds_beside_traffic(replays, num_steps: int, copier, *, rounds: int, stores=(), loads=()
                                ) -> tuple[float, bool, dict[str, float]]:
    """Seconds per step of `replays` while `rounds` of `stores` and of `loads` (either may be
    empty) run on the copier's streams, unordered against compute (whose replays start once
    every copy has begun); whether the copies ran until the last step ended; each direction's
    bytes/s."""
    import torch

    from spillway.worker.kv_tier.block_copies import copy_blocks

    torch.cuda.synchronize()
    compute = torch.cuda.current_stream()
    origin = torch.cuda.Event(enable_timing=True)
    origin.record()
    traffic = {}
    for way, stream, src, dst, pairs in (
            ("to host", copier.store_stream, copier.gpu_pool, copier.cpu_pool, stores),
            ("to GPU", copier.load_stream, copier.cpu_pool, copier.gpu_pool, loads)):
        if not pairs:
            continue
        begun, ended = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        stream.wait_stream(compute)  # after `origin`
        with torch.cuda.stream(stream):
            begun.record()
            for _ in range(rounds):
                copy_blocks(src, dst, pairs)
            ended.record()
        compute.wait_event(begun)
        traffic[way] = (begun, ended, len(pairs))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    replays()
    end.record()
    torch.cuda.synchronize()
    steps_end_ms = origin.elapsed_time(end)
    covered = all(origin.elapsed_time(ended) >= steps_end_ms for _, ended, _ in traffic.values())
    rates = {way: rounds * count * copier.block_bytes / (begun.elapsed_time(ended) / 1e3)
             for way, (begun, ended, count) in traffic.items()}
    return start.elapsed_time(end) / 1e3 / num_steps, covered, rates


def run_reload(args, rows: Rows) -> None:
    """The prefix's KV in GPU slots 0..n-1 (written by the recompute), stored to CPU slots
    0..n-1 and restored from there; medians of 3 recomputes (after one that compiles) and of 5
    restores."""
    import torch

    from spillway.worker.runner.model_runner import ChunkInput

    num_blocks = math.ceil(args.prefix_tokens / args.block_size)
    engine = make_engine(args, max_model_len=num_blocks * args.block_size, max_num_seqs=1,
                         num_gpu_blocks=num_blocks, num_cpu_blocks=num_blocks, enforce_eager=True,
                         max_num_batched_tokens=args.chunk_tokens)
    runner, copier = engine.runner, engine.executor.kv_copier
    rng = random.Random(3)
    tokens = [rng.randrange(256, engine.vocab_size) for _ in range(args.prefix_tokens)]
    table = list(range(num_blocks))
    steps = [ChunkInput(tokens[start:start + args.chunk_tokens], start,
                        table[:math.ceil(min(start + args.chunk_tokens, len(tokens)) / args.block_size)])
             for start in range(0, len(tokens), args.chunk_tokens)]

    def recompute() -> float:
        torch.cuda.synchronize()
        started = time.perf_counter()
        for step in steps:
            runner.execute([step])
        torch.cuda.synchronize()
        return time.perf_counter() - started

    recompute()
    recompute_s = sorted(recompute() for _ in range(3))[1]
    reload_s = sorted(copier.time_copies(num_blocks)[1] for _ in range(5))[2]
    rows.add(row(f"reload a {args.prefix_tokens}-token prefix", reload_s * 1e3, "ms", "recompute",
                 recompute_s * 1e3, recompute_s / reload_s, target=TARGET_RELOAD_SPEEDUP,
                 note=f"{num_blocks} blocks ({num_blocks * copier.block_bytes / 2**30:.2f} GiB) through "
                      f"KVCopier.run, contiguous slots; recompute: {len(steps)} eager prefill steps of up to "
                      f"{args.chunk_tokens} tokens, {args.model} dummy weights; ratio recompute / reload"))
