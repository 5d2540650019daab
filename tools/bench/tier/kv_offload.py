"""The CPU tier's copies on the GPU, each row against a baseline measured in the same run.

    python tools/bench/tier/kv_offload.py                                  # every row, Qwen3-8B blocks
    python tools/bench/tier/kv_offload.py --rows copies,both --blocks 4096
    python tools/bench/tier/kv_offload.py --rows reload --prefix-tokens 32768
    python tools/bench/tier/kv_offload.py --model smollm2-135m --blocks 8192

    copies        store (GPU -> pinned host) and restore (host -> GPU) GB/s through the engine's
                  copier, one contiguous run of slots and every other slot (one transfer per
                  block), against `tensor.copy_` of one pinned buffer of the same size; and
                  whether a store, a wipe and a restore give back the same bytes
    both          one `KVCopier.run` with --blocks stores and --blocks loads of disjoint slots:
                  bytes moved both ways over the wall time, against two plain `copy_`s of the
                  same spans on two streams at once
    interference  a decode step (its captured graph at batch --decode-batch, --decode-context
                  tokens each, dummy weights) while stores and loads of --blocks blocks run
                  without pause on the copier's streams, against the same step alone; then
                  steps queued one at a time (as the engine runs) beside a CPU hit's loads,
                  with and without stores ahead of eviction, at full speed and paced by the
                  copier (worker/kv_tier/paced_loads.py); with --paced-load-gb-s, also beside loads
                  paced to those rates by a host thread
    reload        restoring a --prefix-tokens prefix's blocks from the CPU pool through the
                  copier, against recomputing it: eager prefill forwards of --chunk-tokens tokens
                  each (the engine's steps of max_num_batched_tokens), host time included

Rows are printed as they are measured and again as one table; --results FILE appends each row
(with command, machine and date) as a JSON line. Record figures in docs/performance.md.
"""

from __future__ import annotations

import argparse
import gc
from datetime import date


from spillway.tools.bench import result_rows  # noqa: E402
from spillway.tools.bench.ceilings import machine  # noqa: E402
from spillway.tools.bench.tier.offload_model_rows import run_interference, run_reload  # noqa: E402
from spillway.tools.bench.result_rows import Rows, print_table, row  # noqa: E402

ROW_NAMES = ("copies", "both", "interference", "reload")
TARGET_BOTH_WAYS_GB_S = 75.0


def row_names(text: str) -> tuple[str, ...]:
    """`--rows`: comma-separated names from ROW_NAMES, each run once, in the order given."""
    names = tuple(dict.fromkeys(name.strip() for name in text.split(",") if name.strip()))
    unknown = [name for name in names if name not in ROW_NAMES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown rows {', '.join(map(repr, unknown))} (choose from "
                                         f"{','.join(ROW_NAMES)})" if unknown else "no rows given")
    return names


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def gb_rates(text: str) -> tuple[float, ...]:
    try:
        rates = tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"not comma-separated numbers: {text!r}") from None
    if not rates or min(rates) <= 0:
        raise argparse.ArgumentTypeError(f"rates must be positive GB/s, got {text!r}")
    return rates


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=row_names, default=ROW_NAMES, help=f"comma-separated: {','.join(ROW_NAMES)}")
    parser.add_argument("--model", default="qwen3-8b", help="built-in config whose KV blocks are copied, and "
                                                            "the model of the interference and reload rows")
    parser.add_argument("--blocks", type=positive_int, default=2048, help="blocks copied each way")
    parser.add_argument("--block-size", type=positive_int, default=16)
    parser.add_argument("--decode-batch", type=positive_int, default=64)
    parser.add_argument("--decode-context", type=positive_int, default=2048, help="tokens of each decoding sequence")
    parser.add_argument("--decode-steps", type=positive_int, default=50, help="graph replays timed together")
    parser.add_argument("--paced-load-gb-s", type=gb_rates, default=(), help="interference: also the step beside "
                        "loads paced to these rates, comma-separated GB/s (does a lower rate cost it less?)")
    parser.add_argument("--prefix-tokens", type=positive_int, default=32768)
    parser.add_argument("--chunk-tokens", type=positive_int, default=8192, help="tokens per recompute step")
    parser.add_argument("--results", help="append every row here as a JSON line")
    return parser.parse_args(argv)


def block_shape(args) -> tuple[int, ...]:
    """One KV block of `args.model`: `[num_layers, kv_sides, block_size, kv_heads, head_dim]`."""
    from spillway.protocol.local.model_files import load_config, resolve_model
    from spillway.worker.runner.kv_blocks import kv_block_shape

    return kv_block_shape(load_config(resolve_model(args.model, "dummy")), args.block_size)


def pooled_copier(args, num_slots: int):
    """A KVCopier between a random GPU pool and a pinned CPU pool of `num_slots` blocks each,
    paced as an engine's (its default rate; the burst of the reference model's step, Qwen3-8B's
    on the H200; the speed guess of this machine's link: worker/driver/timing.py)."""
    import torch

    from spillway.protocol.config import WorkerConfig
    from spillway.worker.driver.timing import REFERENCE_DECODE_STEP_S, LinkTiming, StepTiming
    from spillway.worker.kv_tier.copier import KVCopier
    from spillway.worker.kv_tier.host_pool import allocate_cpu_pool, time_host_to_device

    shape = block_shape(args)
    gpu = torch.randn((num_slots, *shape), dtype=torch.bfloat16, device="cuda")
    return KVCopier(gpu, allocate_cpu_pool(num_slots, shape, torch.bfloat16, pinned=True),
                    load_bytes_per_s=WorkerConfig(model=args.model).kv_load_gb_s * 1e9,
                    load_burst_s=StepTiming.derive(REFERENCE_DECODE_STEP_S).load_burst_s,
                    load_speed_guess=LinkTiming.derive(time_host_to_device(gpu.device)).load_speed_guess)


def timed_seconds(queue) -> float:
    """Device seconds from before `queue()` until compute has waited for all it queued."""
    import torch

    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    queue()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def median(values) -> float:
    values = sorted(values)
    return values[len(values) // 2]


def run_copies(args, rows: Rows) -> None:
    import torch

    copier = pooled_copier(args, num_slots=2 * args.blocks)  # room for every other slot
    total = args.blocks * copier.block_bytes
    host = torch.empty(total // 2, dtype=torch.bfloat16, pin_memory=True)
    device = torch.empty_like(host, device="cuda")
    baseline = {"store": total / median(timed_seconds(lambda: host.copy_(device, non_blocking=True))
                                        for _ in range(5)) / 1e9,
                "restore": total / median(timed_seconds(lambda: device.copy_(host, non_blocking=True))
                                          for _ in range(5)) / 1e9}
    measured = []
    for label, scattered in (("contiguous run", False), ("every other slot", True)):
        times = sorted(copier.time_copies(args.blocks, scattered=scattered) for _ in range(5))[2]
        measured += [(f"{direction}, {label}", direction, total / seconds / 1e9)
                     for direction, seconds in zip(("store", "restore"), times)]
    note = (f"{args.blocks} blocks of {copier.block_bytes / 2**20:.2f} MiB ({total / 2**30:.2f} GiB); bytes after "
            f"a store, a wipe and a restore equal the original: {stored_bytes_come_back(copier, args.blocks)}")
    for name, direction, rate in measured:
        rows.add(row(name, rate, "GB/s", "pinned copy_", baseline[direction], rate / baseline[direction], note=note))


def stored_bytes_come_back(copier, num_blocks: int) -> bool:
    import torch

    from spillway.worker.core.step_plan import KVCopies

    original = copier.gpu_pool[:num_blocks].clone()
    slots = tuple((slot, slot) for slot in range(num_blocks))
    copier.run(KVCopies(gpu_to_cpu=slots))
    torch.cuda.synchronize()
    copier.gpu_pool[:num_blocks].zero_()
    copier.run(KVCopies(cpu_to_gpu=slots))
    copier.landed_through(wait=True)
    return torch.equal(copier.gpu_pool[:num_blocks], original)


def run_both(args, rows: Rows) -> None:
    """Stores of GPU slots 0..n-1 into CPU slots 0..n-1 and loads of CPU slots n..2n-1 into GPU
    slots n..2n-1, in one step; the baseline copies the same two spans."""
    import torch

    from spillway.worker.core.step_plan import KVCopies

    n = args.blocks
    copier = pooled_copier(args, num_slots=2 * n)
    gpu, cpu = copier.gpu_pool, copier.cpu_pool
    cpu.copy_(gpu.neg())  # every byte differs from its GPU slot's until copied
    copies = KVCopies(gpu_to_cpu=tuple((slot, slot) for slot in range(n)),
                      cpu_to_gpu=tuple((slot, slot) for slot in range(n, 2 * n)))

    def copier_step() -> None:
        copier.run(copies)
        torch.cuda.current_stream().wait_stream(copier.load_stream)  # the timing covers the loads

    ours = median(timed_seconds(copier_step) for _ in range(5))
    equal = torch.equal(cpu[:n].cuda(), gpu[:n]) and torch.equal(gpu[n:], cpu[n:].cuda())
    spans = ((cpu[:n], gpu[:n]), (gpu[n:], cpu[n:]))
    streams = [torch.cuda.Stream() for _ in spans]

    def two_stream_copies() -> None:
        compute = torch.cuda.current_stream()
        for stream, (dst, src) in zip(streams, spans):
            stream.wait_stream(compute)
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)
        for stream in streams:
            compute.wait_stream(stream)

    baseline = median(timed_seconds(two_stream_copies) for _ in range(5))
    moved = 2 * n * copier.block_bytes
    rows.add(row("both ways at once, one run", moved / ours / 1e9, "GB/s", "copy_ on 2 streams",
                 moved / baseline / 1e9, baseline / ours, target=TARGET_BOTH_WAYS_GB_S, target_is_value=True,
                 note=f"{n} stores + {n} loads of {copier.block_bytes / 2**20:.2f} MiB blocks, disjoint "
                      f"slots; bytes moved both ways / wall time; bytes equal after: {equal}"))


BENCHMARKS = {"copies": run_copies, "both": run_both, "interference": run_interference, "reload": run_reload}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("tools/bench/tier/kv_offload.py needs a CUDA GPU")
    result_rows.MACHINE = machine()
    print(f"{result_rows.MACHINE}, {date.today()}")
    rows = Rows(args.results)
    for name in args.rows:
        BENCHMARKS[name](args, rows)
        gc.collect()  # the next row allocates its own pools: give back this one's
        torch.cuda.empty_cache()
    print()
    print_table(rows.rows)


if __name__ == "__main__":
    main()
