"""The step that lands a shared prefix, as the worker runs it: SEQS requests of NEW new tokens
each on a PREFIX-token prefix already in the GPU cache (the cascade graph of its bucket), against
one such request alone (the prefill graph), Qwen3-8B's shape with dummy weights; with
`--baseline DIR`, the tree at DIR in the same run, alternating. The convoy row of
tools/bench/tier/served.py waits for this step after its shared load: its device time over the lone
request's is most of what the convoy's first tokens pay over the lone one's.

    python tools/bench/tier/landing.py                          # 50 x 4 on 10,000 and 1 x 4
    python tools/bench/tier/landing.py --baseline DIR           # (mkdir DIR && git archive REV | tar -x -C DIR)
    python tools/bench/tier/landing.py --convoy 32x16@4096 --profile

Each step is `ModelRunner.execute` (staging, graph replay, logits) timed to its end; medians of
`--steps`. `--profile` adds the convoy step's kernels (device time, descending).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
BLOCK_SIZE = 16


def landing_chunks(seqs: int, new: int, prefix_len: int, vocab: int, seed: int = 0) -> list:
    """`seqs` chunks of `new` random tokens at position `prefix_len`, each on the prefix's
    blocks 0.. and blocks of its own after them."""
    from spillway.worker.runner.model_runner import ChunkInput

    rng = random.Random(seed)
    prefix = list(range(prefix_len // BLOCK_SIZE))
    own = -(-new // BLOCK_SIZE)
    first = len(prefix)
    return [ChunkInput([rng.randrange(vocab) for _ in range(new)], prefix_len,
                       [*prefix, *range(first + i * own, first + (i + 1) * own)]) for i in range(seqs)]


def synchronize() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def step_ms(runner, chunks: list, steps: int) -> float:
    """Median wall milliseconds of `runner.execute(chunks)` to its logits on the host's clock."""
    times = []
    for _ in range(3 + steps):
        synchronize()
        begun = time.perf_counter()
        runner.execute(chunks)
        synchronize()
        times.append((time.perf_counter() - begun) * 1e3)
    return statistics.median(times[3:])


def kernel_table(runner, chunks: list, rows: int = 14) -> str:
    """The step's kernels by device time (3 steps under the profiler, per step; on the CPU its
    operators' own time)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            runner.execute(chunks)
        synchronize()
    events = [e for e in prof.key_averages() if not cuda or e.device_time_total > 0]

    def spent(event) -> float:
        return event.device_time_total if cuda else event.self_cpu_time_total

    lines = [f"{'kernel':<64} {'us/step':>9} {'calls':>6}"]
    for event in sorted(events, key=lambda e: -spent(e))[:rows]:
        lines.append(f"{event.key[:64]:<64} {spent(event) / 3:9.1f} {event.count // 3:6d}")
    lines.append(f"{'all':<64} {sum(map(spent, events)) / 3:9.1f} {sum(e.count for e in events) // 3:6d}")
    return "\n".join(lines)


def landing_engine(model: str, seqs: int, new: int, prefix_len: int):
    """An engine (dummy weights, bfloat16, CUDA where there is one) whose GPU pool holds the
    prefix's blocks and `seqs` requests' own blocks after them."""
    import torch

    from spillway.protocol.local.envs import worker_config_from_env
    from spillway.worker.driver.engine import Engine

    num_blocks = prefix_len // BLOCK_SIZE + seqs * -(-new // BLOCK_SIZE) + 64
    return Engine(worker_config_from_env(model=model, load_format="dummy", dtype="bfloat16",
                                         device="cuda" if torch.cuda.is_available() else "cpu",
                                         max_model_len=prefix_len + new + 64, num_gpu_blocks_override=num_blocks))


def measure(model: str, seqs: int, new: int, prefix_len: int, steps: int, profile: bool) -> dict:
    """This process's tree (whatever `spillway` imports): the convoy's and the lone step."""
    engine = landing_engine(model, seqs, new, prefix_len)
    runner = engine.executor.runner
    runner.kv_cache.normal_(0, 0.5)
    convoy = landing_chunks(seqs, new, prefix_len, engine.vocab_size)
    result = {"convoy_ms": step_ms(runner, convoy, steps), "lone_ms": step_ms(runner, convoy[:1], steps)}
    result["convoy_ms_again"] = step_ms(runner, convoy, steps)
    if profile:
        result["kernels"] = kernel_table(runner, convoy)
    return result


def run_tree(tree: Path | None, args) -> dict:
    """`measure` in a child process importing `tree` (None: the installed spillway)."""
    from spillway.tools.bench.serve.server_process import tree_env

    command = [sys.executable, __file__, "--child", "--model", args.model, "--convoy", f"{args.convoy[0]}x{args.convoy[1]}@{args.convoy[2]}",
               "--steps", str(args.steps)] + (["--profile"] if args.profile else [])
    done = subprocess.run(command, env=tree_env(tree), cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"the child for {tree or 'this tree'} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    from spillway.tools.bench.kernels.attention import parse_convoy

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--convoy", type=parse_convoy, default=parse_convoy("50x4@10000"), help="SEQSxNEW@PREFIX")
    parser.add_argument("--model", default="qwen3-8b", help="built-in config (dummy weights)")
    parser.add_argument("--baseline", type=Path, help="a source tree to compare against, in the same run")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each tree, alternating")
    parser.add_argument("--steps", type=int, default=20, help="timed steps of each shape a run")
    parser.add_argument("--profile", action="store_true", help="the convoy step's kernels, each tree")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args.model, *args.convoy, args.steps, args.profile)))
        return
    from spillway.tools.bench.ceilings import machine

    seqs, new, prefix_len = args.convoy
    print(f"{machine()}; {seqs} x {new} new tokens on a {prefix_len:,}-token cached prefix against 1 x {new}, "
          f"{args.model} shape, ms a step (medians of {args.steps})", flush=True)
    trees = {"this tree": None} if args.baseline is None else {"baseline": args.baseline, "this tree": None}
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    for _ in range(args.repeats):
        for name, tree in trees.items():
            runs[name].append(run_tree(tree, args))
            if args.profile and len(runs[name]) == 1:
                print(f"\n{name}: the convoy step's kernels\n{runs[name][0]['kernels']}", flush=True)
    print(f"\n{'tree':>10} {'convoy':>8} {'lone':>8} {'convoy - lone':>14}   runs (convoy, lone)")
    medians = {}
    for name, results in runs.items():
        convoy = statistics.median(r[key] for r in results for key in ("convoy_ms", "convoy_ms_again"))
        lone = statistics.median(r["lone_ms"] for r in results)
        medians[name] = convoy
        each = ", ".join(f"({r['convoy_ms']:.2f}, {r['lone_ms']:.2f})" for r in results)
        print(f"{name:>10} {convoy:8.2f} {lone:8.2f} {convoy - lone:14.2f}   {each}")
    if args.baseline is not None:
        print(f"convoy step, baseline / this tree: {medians['baseline'] / medians['this tree']:.3f}x")


if __name__ == "__main__":
    main()
