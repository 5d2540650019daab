"""The convoy shape of tools/bench/kernels/attention.py (`--convoy`): many sequences with a few new tokens
each on one long shared prefix (a batch of users on one document or system prompt), through
cascade attention and through the prefill kernel, in the same run.

The inputs are built by `convoy_inputs` on any device, so the CPU tests run the same code
through Triton's interpreter on a small convoy; only `bench_convoy` needs a GPU.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import torch

from spillway.kernels.cascade_attention import cascade_attention, cascade_num_splits
from spillway.kernels.paged_attention_prefill import paged_prefill_attention
from spillway.kernels.utils import multiprocessor_count
from spillway.worker.runner.cuda_graphs import PREFILL_TOKEN_BUCKETS
from spillway.worker.attention.shared_prefix import shared_prefix_len

QWEN3_8B_HEADS = (32, 8, 128)  # query heads, KV heads, head_dim


@dataclass(slots=True)
class Convoy:
    """One layer's step: q `[seqs * new, heads, head_dim]`, a cache of one layer and int32 tables
    whose first `prefix_len // block_size` entries are the same blocks in every row."""

    q: torch.Tensor
    kv_cache: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    starts: list[int]
    prefix_len: int
    new: int


def convoy_inputs(seqs: int, new: int, prefix_len: int, *, heads: tuple[int, int, int] = QWEN3_8B_HEADS,
                  block_size: int = 16, own_max: int = 15, dtype: torch.dtype = torch.bfloat16,
                  device: torch.device | str = "cuda", seed: int = 0) -> Convoy:
    """`seqs` sequences of `new` new tokens after `prefix_len` shared tokens and 0..`own_max`
    cached tokens of their own (seed `seed`); blocks past the prefix are each sequence's own."""
    num_heads, num_kv_heads, head_dim = heads
    generator = torch.Generator().manual_seed(seed)
    own = torch.randint(0, own_max + 1, (seqs,), generator=generator).tolist()
    prefix_blocks = prefix_len // block_size
    own_blocks = [-(-(prefix_len + n + new) // block_size) - prefix_blocks for n in own]
    tables = torch.zeros(seqs, prefix_blocks + max(own_blocks), dtype=torch.int32)
    tables[:, :prefix_blocks] = torch.arange(prefix_blocks, dtype=torch.int32)
    next_block = prefix_blocks
    for seq, count in enumerate(own_blocks):
        tables[seq, prefix_blocks : prefix_blocks + count] = torch.arange(next_block, next_block + count)
        next_block += count
    cache = torch.randn(next_block, 1, 2, block_size, num_kv_heads, head_dim, generator=generator).to(dtype)
    q = torch.randn(seqs * new, num_heads, head_dim, generator=generator).to(dtype)
    starts = [prefix_len + n for n in own]
    query_start_loc = torch.tensor([0, *itertools.accumulate([new] * seqs)], dtype=torch.int32)
    seq_lens = torch.tensor([start + new for start in starts], dtype=torch.int32)
    return Convoy(q.to(device), cache.to(device), query_start_loc.to(device), seq_lens.to(device),
                  tables.to(device), starts, prefix_len, new)


# A prefill graph sizes cascade attention's prefix splits for the longest prefix its block
# tables reach: max_model_len, 40,960 positions for Qwen3-8B.
GRAPH_REACH = 40960


def convoy_launches(convoy: Convoy, split_counts=(1, 2, 4, 8, 16)) -> dict[str, callable]:
    """Labelled calls, each returning the step's attention: the prefill kernel as an eager step
    runs it (1 split) first, then cascade attention with the split count an eager step picks
    ("default"), the one a prefill graph of the step's token bucket picks ("graph", fixed by
    its shapes and GRAPH_REACH), and each of `split_counts`."""
    c = convoy
    arguments = (c.q, c.kv_cache, 0, c.query_start_loc, c.seq_lens, c.block_tables, c.q.shape[2] ** -0.5, c.new)
    launches = {"prefill kernel": lambda: paged_prefill_attention(*arguments)}
    num_kv_heads, rows = c.kv_cache.shape[4], c.q.shape[0]
    heads = (num_kv_heads, c.q.shape[1] // num_kv_heads, c.q.shape[2])
    num_sms = multiprocessor_count(c.q.device)
    bucket = min((size for size in PREFILL_TOKEN_BUCKETS if size >= rows), default=rows)
    counts = {"default": cascade_num_splits(rows, *heads, c.prefix_len, num_sms),
              "graph": cascade_num_splits(bucket, *heads, GRAPH_REACH, num_sms)}
    counts.update({str(splits): splits for splits in split_counts})
    prefix_len = torch.tensor([c.prefix_len], dtype=torch.int32, device=c.q.device)
    for name, splits in counts.items():
        label = f"cascade, {splits} splits" if name == str(splits) else f"cascade, {name}: {splits} splits"
        launches[label] = lambda splits=splits: cascade_attention(*arguments, prefix_len, splits)
    return launches


def kv_bytes(convoy: Convoy, cascade: bool) -> int:
    """Keys and values read: every context in full, or the prefix once and each sequence's own."""
    tokens = int(convoy.seq_lens.sum())
    if cascade:
        tokens -= (len(convoy.starts) - 1) * convoy.prefix_len
    num_kv_heads, head_dim = convoy.kv_cache.shape[4], convoy.kv_cache.shape[5]
    return tokens * num_kv_heads * head_dim * 2 * convoy.kv_cache.element_size()


def detection_us(convoy: Convoy, repeats: int = 1000) -> float:
    """Host microseconds of finding the shared prefix on a host copy of the tables."""
    host_tables = convoy.block_tables.cpu().numpy()
    begin = time.perf_counter()
    for _ in range(repeats):
        found = shared_prefix_len(convoy.starts, host_tables, convoy.kv_cache.shape[3])
    assert found == convoy.prefix_len, f"found a shared prefix of {found} tokens, built {convoy.prefix_len}"
    return (time.perf_counter() - begin) / repeats * 1e6


def bench_convoy(seqs: int, new: int, prefix_len: int) -> None:
    from spillway.tools.bench.ceilings import bench_ms, machine

    convoy = convoy_inputs(seqs, new, prefix_len)
    print(f"{machine()}; {seqs} sequences x {new} new tokens on a shared prefix of {prefix_len} tokens, "
          f"Qwen3-8B heads, bf16 cache, one layer; finding the prefix: {detection_us(convoy):.1f} us on the host")
    print(f"{'path':>27} {'us':>9} {'KV MB read':>11} {'max rel err':>11} {'speed vs prefill':>16}")
    baseline_out = baseline_us = None
    for label, launch in convoy_launches(convoy).items():
        out = launch()
        baseline_out = baseline_out if baseline_out is not None else out
        error = float((out.float() - baseline_out.float()).norm() / baseline_out.float().norm())
        us = 1e3 * bench_ms(launch)
        baseline_us = baseline_us or us
        megabytes = kv_bytes(convoy, label.startswith("cascade")) / 1e6
        print(f"{label:>27} {us:9.1f} {megabytes:11.1f} {error:11.2e} {baseline_us / us:15.2f}x")


def tune_convoy(seqs: int, new: int, prefix_len: int) -> None:
    """Cascade attention's prefix pass (rows per program, keys per tile, warps, pipeline stages,
    key splits) on one convoy: the prefix pass alone and both passes, each against the launch's
    defaults (the first line) in the same run; outputs checked against the prefill kernel's."""
    from spillway.kernels.cascade_attention import PREFIX_N, PREFIX_ROWS, PREFIX_STAGES, PREFIX_WARPS, launch
    from spillway.tools.bench.ceilings import bench_ms, machine

    c = convoy_inputs(seqs, new, prefix_len)
    rows, num_heads, head_dim = c.q.shape
    num_kv_heads = c.kv_cache.shape[4]
    heads = (num_kv_heads, num_heads // num_kv_heads, head_dim)
    arguments = (c.q, c.kv_cache, 0, c.query_start_loc, c.seq_lens, c.block_tables, head_dim ** -0.5, c.new)
    reference = paged_prefill_attention(*arguments).float()
    prefix = torch.tensor([c.prefix_len], dtype=torch.int32, device=c.q.device)
    default_splits = cascade_num_splits(rows, *heads, c.prefix_len, multiprocessor_count(c.q.device))
    flops = 4 * rows * num_heads * prefix_len * head_dim
    print(f"{machine()}; {seqs} x {new} new tokens on a {prefix_len}-token prefix, one layer, Qwen3-8B heads; "
          f"prefix pass {flops / 1e9:.1f} GFLOP, prefix KV {kv_bytes(c, True) / 1e6:.1f} MB")
    print(f"{'rows':>5} {'keys':>5} {'warps':>5} {'stages':>6} {'splits':>6} {'prefix us':>9} {'TFLOP/s':>8} "
          f"{'both us':>8} {'rel err':>9} {'vs default':>10}")
    baseline_us = None
    configs = [(PREFIX_ROWS, PREFIX_N, PREFIX_WARPS, PREFIX_STAGES, default_splits)] + [
        (prefix_rows, prefix_n, warps, stages, splits)
        for prefix_rows in (128, 256) for prefix_n in (64, 128) for warps in (4, 8) for stages in (2, 3, 4)
        for splits in sorted({2, 4, 6, max(1, default_splits // 2), default_splits, 2 * default_splits})]
    results = []
    for prefix_rows, prefix_n, warps, stages, splits in configs:
        out = torch.empty_like(c.q)
        tiles = dict(prefix_rows=prefix_rows, prefix_n=prefix_n, prefix_warps=warps, prefix_stages=stages)

        def launch(passes=("prefix", "suffix")):
            return launch(*arguments, prefix, splits, out, passes=passes, **tiles)
        label = f"{prefix_rows:>5} {prefix_n:>5} {warps:>5} {stages:>6} {splits:>6}"
        try:
            error = float((launch().float() - reference).norm() / reference.norm())
            prefix_us = 1e3 * bench_ms(lambda: launch(("prefix",)), warmup=20, rep=100)
            us = 1e3 * bench_ms(launch, warmup=20, rep=100)
        except Exception as exc:  # a tile too large for the SM's resources: say so and go on
            print(f"{label}  failed: {type(exc).__name__}: {str(exc).splitlines()[0][:80]}")
            continue
        baseline_us = baseline_us or us
        line = (f"{label} {prefix_us:9.1f} {flops / prefix_us / 1e6:8.1f} {us:8.1f} {error:9.2e} "
                f"{baseline_us / us:9.2f}x")
        results.append((us, line))
        print(line, flush=True)
    print("fastest (both passes):")
    for _, line in sorted(results)[:8]:
        print(line)
