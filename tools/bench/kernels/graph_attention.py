"""The prefill and cascade attention kernels as prefill CUDA graphs run them: a graph's token
bucket of rows and its sequence slots (padding included), every layer of a Qwen3-8B-shaped
cache (36 layers, cross-layer blocks), 36 launches captured in one graph and replayed; each
case's microseconds a layer against a baseline tree's in the same run.

    python tools/bench/kernels/graph_attention.py                      # this tree
    python tools/bench/kernels/graph_attention.py --baseline DIR       # and the tree at DIR, alternating
                                                               #   (mkdir DIR && git archive REV | tar -x -C DIR)
    python tools/bench/kernels/graph_attention.py --suffix-rows 16     # cascade's suffix pass at 16 rows a program

Cases (bf16, blocks of 16 tokens, 32 query and 8 KV heads of 128):

    convoy      cascade: 50 sequences x 4 new tokens on a 10,000-token shared prefix, 208-row graph of 64 slots
    long own    cascade: 2 x 128 new tokens after 3,000 and 2,500 own keys on a 2,048-token prefix, 256 rows, 64 slots
    lone        prefill kernel: 1 x 4 new tokens after 10,000 cached, 16 rows and slots, its key splits
    long query  prefill kernel: 1 x 2,048 new tokens, 2,048 rows, 64 slots

Each launch is first checked against the prefill reference on one layer (relative error).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
LAYERS = 36
HEADS = (32, 8, 128)  # query heads, KV heads, head_dim
SCALE = 128 ** -0.5
# name: (kernel, shared prefix, own cached keys per sequence, new tokens per sequence, slots, bucket)
CASES = {
    "convoy": ("cascade", 10_000, [0] * 50, [4] * 50, 64, 208),
    "long own": ("cascade", 2048, [3000, 2500], [128, 128], 64, 256),
    "lone": ("prefill", 0, [10_000], [4], 16, 16),
    "long query": ("prefill", 0, [0], [2048], 64, 2048),
}


def graph_batch(prefix_len: int, own: list[int], new: list[int], slots: int, bucket: int, *, layers: int = LAYERS,
                heads=HEADS, block_size: int = 16, dtype=None, device="cuda") -> dict:
    """A ragged batch as a prefill graph holds it: `len(new)` sequences sharing the first
    `prefix_len` positions' blocks, then their own, padded to `slots` sequences (empty: no
    query, no context) and `bucket` rows of q."""
    import torch

    num_heads, num_kv_heads, head_dim = heads
    dtype = dtype or torch.bfloat16
    generator = torch.Generator().manual_seed(0)
    shared = prefix_len // block_size
    lens = [prefix_len + o + n for o, n in zip(own, new)]
    owned = [-(-n // block_size) - shared for n in lens]
    tables = torch.zeros(slots, shared + max(owned) + 1, dtype=torch.int32)
    tables[: len(new), :shared] = torch.arange(shared, dtype=torch.int32)
    for seq, first in enumerate(itertools.accumulate([shared, *owned[:-1]])):
        tables[seq, shared: shared + owned[seq]] = torch.arange(first, first + owned[seq])
    blocks = shared + sum(owned) + 1
    cache = torch.randn(blocks, layers, 2, block_size, num_kv_heads, head_dim, generator=generator).to(dtype)
    starts = [0, *itertools.accumulate(new)]
    starts += [starts[-1]] * (slots - len(new))
    q = torch.randn(bucket, num_heads, head_dim, generator=generator).to(dtype)
    as_int = dict(dtype=torch.int32, device=device)
    return dict(q=q.to(device), cache=cache.to(device), starts=torch.tensor(starts, **as_int),
                lens=torch.tensor(lens + [0] * (slots - len(new)), **as_int), tables=tables.to(device),
                prefix=torch.tensor([prefix_len], **as_int), seqs=len(new), rows=sum(new))


def launcher(kind: str, b: dict, suffix_rows: int | None = None):
    """`run(layer)`: the case's kernel(s) on one layer, as the graph launches them."""
    from spillway.kernels import cascade_attention, paged_attention_prefill
    from spillway.kernels.utils import multiprocessor_count

    q, num_kv_heads = b["q"], b["cache"].shape[4]
    shape = (num_kv_heads, q.shape[1] // num_kv_heads, q.shape[2])
    num_sms = multiprocessor_count(q.device)
    arguments = (q, b["cache"], b["starts"], b["lens"], b["tables"], SCALE, q.shape[0])
    if kind == "cascade":
        splits = cascade_attention.cascade_num_splits(q.shape[0], *shape, int(b["prefix"][0]), num_sms)
        tiles = {} if suffix_rows is None else {"suffix_rows": suffix_rows}

        def run(layer):
            args = (arguments[0], arguments[1], layer, *arguments[2:])
            return cascade_attention.cascade_attention(*args, b["prefix"], splits, **tiles)
    else:
        splits = paged_attention_prefill.prefill_num_splits(q.shape[0], b["tables"].shape[0], *shape, num_sms)

        def run(layer):
            args = (arguments[0], arguments[1], layer, *arguments[2:])
            return paged_attention_prefill.paged_prefill_attention(*args, splits)
    return run


def check(run, b: dict, layer: int = 1) -> float:
    """Relative error of the launch's real rows against the prefill reference of `layer`."""
    from spillway.kernels.ragged_attention_reference import paged_prefill_attention_reference

    seqs, rows = b["seqs"], b["rows"]
    got = run(layer)[:rows].float()
    expected = paged_prefill_attention_reference(b["q"], b["cache"], layer, b["starts"][: seqs + 1], b["lens"][:seqs],
                                                 b["tables"][:seqs], SCALE)[:rows].float()
    return float((got - expected).norm() / expected.norm())


def graph_us(run, layers: int = LAYERS, replays: int = 20) -> float:
    """Median microseconds a layer of one graph replay holding `layers` launches."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for layer in range(3):
            run(layer)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for layer in range(layers):
            run(layer)
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / layers)
    return statistics.median(times)


def measure(suffix_rows: int | None) -> dict[str, dict]:
    """Every case in this process (whatever `spillway` imports): error and us a layer."""
    import torch

    results = {}
    for name, (kind, *shape) in CASES.items():
        b = graph_batch(*shape)
        run = launcher(kind, b, suffix_rows)
        error = check(run, b)
        results[name] = {"error": error, "us": statistics.median(graph_us(run) for _ in range(3))}
        del b, run
        torch.cuda.empty_cache()
    return results


def tree_pythonpath(tree: Path) -> str:
    """A PYTHONPATH under which `spillway` is the source tree at `tree`."""
    site = Path(tempfile.mkdtemp(prefix="bench-graph-attention-"))
    (site / "spillway").symlink_to(tree.resolve())
    return os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))


def run_tree(tree: Path | None, suffix_rows: int | None) -> dict[str, dict]:
    """`measure` in a child process importing `tree` (None: this one) as spillway."""
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = tree_pythonpath(tree)
    command = [sys.executable, __file__, "--child"] + (["--suffix-rows", str(suffix_rows)] if suffix_rows else [])
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", type=Path, help="a source tree to compare against, in the same run")
    parser.add_argument("--suffix-rows", type=int, help="cascade's suffix pass rows per program, 16 or 64 (this tree only)")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each tree, alternating")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.suffix_rows)))
        return
    from spillway.tools.bench.ceilings import machine

    print(f"{machine()}; {LAYERS} launches a graph, us a layer (medians)")
    runs = {"this tree": [], "baseline": []}
    for _ in range(args.repeats):
        if args.baseline:
            runs["baseline"].append(run_tree(args.baseline, None))
        runs["this tree"].append(run_tree(None, args.suffix_rows))
    print(f"{'case':>11} {'this tree':>10} {'baseline':>10} {'ratio':>7} {'rel err':>9}   runs")
    for name in CASES:
        ours = statistics.median(run[name]["us"] for run in runs["this tree"])
        error = max(run[name]["error"] for run in runs["this tree"])
        line = f"{name:>11} {ours:10.1f}"
        if runs["baseline"]:
            theirs = statistics.median(run[name]["us"] for run in runs["baseline"])
            line += f" {theirs:10.1f} {theirs / ours:6.3f}x"
        else:
            line += f" {'':>10} {'':>7}"
        print(f"{line} {error:9.1e}   {[round(run[name]['us'], 1) for run in runs['this tree']]}")


if __name__ == "__main__":
    main()
