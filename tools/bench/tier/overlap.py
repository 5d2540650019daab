"""A prefix's load from the CPU tier and the step that computes on it, in one worker process:
the step queued behind the loads layer by layer (each layer computes once its KV has landed:
worker/kv_tier/copier.py) against the step run once the whole load has landed (the host sees the
landing, then replays the step's graph), Qwen3-8B's shape with dummy weights.

    python tools/bench/tier/overlap.py                       # 50 x 4 on 10,000, and 1 x 4 on it
    python tools/bench/tier/overlap.py --convoy 8x16@32768

Each case times, on the host's clock, from queueing the prefix's loads (`KVCopier.run`) to the
step's logits on the host: the load alone (in groups of layers, and in whole blocks as before
the groups), the step after the landing, and the step by layer
(with the host time its launch took, which must stay under the load's for the overlap to
hold, and the host time of queueing the loads); medians of `--repeats`. The step's staged
inputs go by kernel, as with the engine's tier (kernels/host_copy.py): a copy engine's input
copy would wait behind the whole load. Without a GPU the loads land as they are queued and every row
is the step after them: the CPU runs only check the tool.
"""

from __future__ import annotations

import argparse
import statistics
import time


from spillway.tools.bench.tier.landing import BLOCK_SIZE, landing_chunks, landing_engine, synchronize  # noqa: E402


def build(model: str, seqs: int, new: int, prefix_len: int):
    """An engine whose GPU pool holds the convoy's blocks and whose CPU tier holds the prefix's."""
    prefix_blocks = prefix_len // BLOCK_SIZE
    engine = landing_engine(model, seqs, new, prefix_len)
    executor = engine.executor
    if executor.kv_copier is None:
        from spillway.worker.driver.timing import LinkTiming
        from spillway.worker.kv_tier.host_pool import time_host_to_device

        executor.allocate_cpu_kv_cache(prefix_blocks, load_bytes_per_s=0, load_burst_s=engine.timing.load_burst_s,
                                       load_speed_guess=LinkTiming.derive(
                                           time_host_to_device(executor.device)).load_speed_guess)
    if executor.device.type == "cuda":  # as the engine's tier does: staged inputs do not queue behind loads
        from spillway.kernels.host_copy import warm_up_copies

        warm_up_copies(executor.device)
        executor.runner.inputs.stage_by_kernel()
    executor.kv_copier.cpu_pool[:prefix_blocks].normal_(0, 0.5)
    return engine, prefix_blocks


def timed_case(engine, prefix_blocks: int, chunks: list, mode: str) -> tuple[float, float, float]:
    """Milliseconds from queueing the prefix's loads to the step's logits on the host (`mode`
    "load": the loads alone, in groups of layers; "whole blocks": alone, a copy per run of
    whole blocks), and the host milliseconds of queueing the loads and of the step's launch."""
    from spillway.worker.core.step_plan import KVCopies

    from spillway.worker.kv_tier import paced_loads

    copier, runner = engine.executor.kv_copier, engine.executor.runner
    loads = tuple((slot, slot) for slot in range(prefix_blocks))
    groups_at_most = paced_loads.MAX_SLICE_COPIES
    if mode == "whole blocks":
        paced_loads.MAX_SLICE_COPIES = -1  # any batch goes in whole blocks, as before the groups
    synchronize()
    begun = time.perf_counter()
    try:
        copier.run(KVCopies(cpu_to_gpu=loads, load_batch=1))
    finally:
        paced_loads.MAX_SLICE_COPIES = groups_at_most
    queued = time.perf_counter() - begun
    launch = 0.0
    if mode == "by layer":
        launched = time.perf_counter()
        waits = copier.run(KVCopies(wait_for_loads=True, wait_by_layer=True))
        logits = runner.execute(chunks, layer_ready=waits)
        launch = time.perf_counter() - launched
        logits.sum().item()
    else:
        copier.landed_through(wait=True)
        if mode == "after landing":
            launched = time.perf_counter()
            logits = runner.execute(chunks)
            launch = time.perf_counter() - launched
            logits.sum().item()
    ended = time.perf_counter()
    synchronize()
    return (ended - begun) * 1e3, queued * 1e3, launch * 1e3


def measure(args) -> dict[str, dict[str, list[tuple[float, float]]]]:
    seqs, new, prefix_len = args.convoy
    engine, prefix_blocks = build(args.model, seqs, new, prefix_len)
    cases = {"convoy": landing_chunks(seqs, new, prefix_len, engine.vocab_size),
             "lone": landing_chunks(1, new, prefix_len, engine.vocab_size)}
    results = {case: {mode: [] for mode in MODES} for case in cases}
    for _ in range(args.warm_up + args.repeats):
        for case, chunks in cases.items():
            for mode in MODES:
                results[case][mode].append(timed_case(engine, prefix_blocks, chunks, mode))
    for case in results.values():
        for mode in MODES:
            case[mode] = case[mode][args.warm_up:]
    return results


MODES = ("load", "whole blocks", "after landing", "by layer")


def main(argv: list[str] | None = None) -> None:
    from spillway.tools.bench.kernels.attention import parse_convoy
    from spillway.tools.bench.ceilings import machine

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--convoy", type=parse_convoy, default=parse_convoy("50x4@10000"), help="SEQSxNEW@PREFIX")
    parser.add_argument("--model", default="qwen3-8b", help="built-in config (dummy weights)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warm-up", type=int, default=2, help="rounds not counted")
    args = parser.parse_args(argv)
    seqs, new, prefix_len = args.convoy
    print(f"{machine()}; a {prefix_len:,}-token prefix loaded from the CPU tier, then {seqs} x {new} new tokens "
          f"on it, and 1 x {new}; {args.model} shape; ms from the loads' start to the logits "
          f"(medians of {args.repeats})", flush=True)
    results = measure(args)
    print(f"{'case':>7} {'load':>8} {'whole blocks':>13} {'after landing':>14} {'by layer':>9} "
          f"{'after / by layer':>17}   host ms: loads queued (groups, whole blocks), launch (after, by layer)")
    for case, modes in results.items():
        load, whole, after, by_layer = (statistics.median(total for total, _, _ in modes[mode]) for mode in MODES)
        queued = [statistics.median(queue for _, queue, _ in modes[mode]) for mode in MODES[:2]]
        launches = [statistics.median(launch for _, _, launch in modes[mode]) for mode in MODES[2:]]
        print(f"{case:>7} {load:8.2f} {whole:13.2f} {after:14.2f} {by_layer:9.2f} {after / by_layer:17.3f}   "
              f"{queued[0]:.2f}, {queued[1]:.2f}, {launches[0]:.2f}, {launches[1]:.2f}")

if __name__ == "__main__":
    main()
