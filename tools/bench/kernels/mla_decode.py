"""The absorbed MLA decode kernel (kernels/mla_decode.py) on the GPU, against the read bandwidth
measured in the same run and against its plain-torch reference.

    python tools/bench/kernels/mla_decode.py                          # 64 x 4,096 tokens; 16, 128 heads; bf16, fp8
    python tools/bench/kernels/mla_decode.py --shapes 8x32768,256x1024 --heads 128 --cache-dtype fp8
    python tools/bench/kernels/mla_decode.py --json /tmp/mla.jsonl   # also one JSON line a row
    python tools/bench/kernels/mla_decode.py --tune                   # and each launch setting beside the default
    python tools/bench/kernels/mla_decode.py --prefill                # kernels/mla_prefill.py on one 4,096-token prompt

A shape is BATCHxCONTEXT: BATCH sequences of CONTEXT cached tokens each (the new one
included), one query each; DeepSeek V2/V3's latent rows (kv_lora_rank 512 + rope 64 = 576
values), blocks of 16 tokens in shuffled order, bf16 queries.

Each row: the split count the launcher picks; the bytes a call must move (every context
token's row once, the queries and the outputs); the kernel's microseconds a call, as CUDA graph
replays (as the engine's decode graphs run it) alternating over two layers of the cache, so
that no call finds its rows in L2; the GB/s that makes; its fraction of the read bandwidth
measured in this run (tools/bench/ceilings.py); the output's relative error against the
reference; and the baseline with the kernel's speedup over it: the reference,
`paged_mla_decode_reference` (plain torch, sequence by sequence, with host syncs, so timed
eagerly).

--tune: then each of the launch's settings (rows of q and tokens a program, warps, stages,
splits) changed alone from the default, each against the default launch as its baseline.

--prefill: the ragged prefill kernel (kernels/mla_prefill.py) instead, on one fresh prompt of
PROMPT_TOKENS tokens (causal: 2 x (576 + 512) x heads x T (T + 1) / 2 FLOPs), against the bf16
matrix-product rate measured in this run; --tune changes its settings likewise (no splits).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from datetime import date

from spillway.tools.bench.ceilings import bench_ms, machine, matmul_rate, read_bandwidth

DEFAULT_SHAPES = "64x4096"
DEFAULT_HEADS = "16,128"
KV_LORA_RANK, ROPE_DIM = 512, 64
ROW_DIM = KV_LORA_RANK + ROPE_DIM
SCALE = 192**-0.5  # DeepSeek's qk_head_dim: 128 nope + 64 rope
BLOCK_SIZE = 16
LAYERS = 2
PROMPT_TOKENS = 4096
# Changes for --tune, each made alone to the launcher's default settings (kernels/mla_decode.py).
TUNE_CHANGES = [
    {"block_m": 16, "num_warps": 4}, {"block_m": 32, "num_warps": 8}, {"block_m": 64, "num_warps": 8},
    {"block_n": 16}, {"block_n": 64}, {"num_warps": 4}, {"num_warps": 8}, {"num_stages": 2}, {"num_stages": 4},
]


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """`(batch, context)` of each comma-separated `BATCHxCONTEXT`."""
    shapes = []
    for part in text.split(","):
        try:
            batch, context = (int(value) for value in part.split("x"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"shape {part!r} is not BATCHxCONTEXT") from None
        if batch < 1 or context < 1:
            raise argparse.ArgumentTypeError(f"shape {part!r}: batch and context must be positive")
        shapes.append((batch, context))
    return shapes


def parse_heads(text: str) -> list[int]:
    try:
        heads = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"heads {text!r} are not comma-separated integers") from None
    if min(heads) < 1:
        raise argparse.ArgumentTypeError(f"heads {text!r} must be positive")
    return heads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", type=parse_shapes, default=parse_shapes(DEFAULT_SHAPES),
                        help=f"comma-separated BATCHxCONTEXT (default {DEFAULT_SHAPES})")
    parser.add_argument("--heads", type=parse_heads, default=parse_heads(DEFAULT_HEADS),
                        help=f"comma-separated query head counts (default {DEFAULT_HEADS})")
    parser.add_argument("--cache-dtype", choices=["bf16", "fp8", "both"], default="both")
    parser.add_argument("--tune", action="store_true", help="also each launch setting changed alone")
    parser.add_argument("--json", help="append each row to this file as a JSON line")
    parser.add_argument("--prefill", action="store_true",
                        help=f"time the prefill kernel on one {PROMPT_TOKENS:,}-token prompt (--shapes unused)")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("tools/bench/kernels/mla_decode.py needs a CUDA GPU")
    device = torch.device("cuda")
    if args.prefill:
        prefill_main(args, device)
        return
    bandwidth = read_bandwidth()
    print(f"{machine()}; read bandwidth {bandwidth / 1e9:,.0f} GB/s")
    print(f"{'shape':>10} {'heads':>5} {'cache':>5} {'setting':>22} {'splits':>6} {'MB':>8} {'us':>9} {'GB/s':>8} "
          f"{'of bw':>6} {'rel err':>8} {'baseline':>8} {'base us':>9} {'speedup':>8}")
    cache_names = ["bf16", "fp8"] if args.cache_dtype == "both" else [args.cache_dtype]
    for batch, context in args.shapes:
        for num_heads in args.heads:
            for cache_name in cache_names:
                for row in case_rows(batch, context, num_heads, cache_name, bandwidth, args.tune, device):
                    print(f"{row['shape']:>10} {row['heads']:>5} {row['cache']:>5} {row['setting']:>22} "
                          f"{row['splits']:>6} {row['bytes'] / 1e6:8.1f} {row['kernel_us']:9.1f} "
                          f"{row['gbps']:8.1f} {row['of_bandwidth']:6.3f} {row['rel_error']:8.1e} "
                          f"{row['baseline']:>8} {row['baseline_us']:9.1f} {row['speedup']:7.2f}x", flush=True)
                    if args.json:
                        append_json(args.json, row)


def case_rows(batch: int, context: int, num_heads: int, cache_name: str, bandwidth: float, tune: bool, device):
    """The default launch's row, its baseline the reference; then with `tune` one row for each
    of TUNE_CHANGES that changes the default and for the split count halved and doubled, their
    baseline the default launch."""
    from dataclasses import replace

    from triton.runtime.errors import OutOfResources

    from spillway.kernels.mla_decode import default_num_splits, default_settings, launch, paged_mla_decode_reference
    from spillway.tools.bench.kernels.moe_cases import graph_us

    q, cache, tables, lens = build_case(batch, context, num_heads, cache_name, device)
    q4 = q.unsqueeze(1)
    moved = batch * context * ROW_DIM * cache.element_size() + q.numel() * 2 + batch * num_heads * KV_LORA_RANK * 2
    default_splits = default_num_splits(batch, num_heads, tables.shape[1] * BLOCK_SIZE, KV_LORA_RANK,
                                        ROW_DIM * cache.element_size(), device)
    ref = paged_mla_decode_reference(q, cache, 0, tables, lens, kv_lora_rank=KV_LORA_RANK, scale=SCALE).double()
    baseline_us = 1e3 * bench_ms(lambda: paged_mla_decode_reference(q, cache, 0, tables, lens,
                                                                    kv_lora_rank=KV_LORA_RANK, scale=SCALE),
                                 warmup=10, rep=100)
    default = default_settings(num_heads, cache.dtype)
    launches = [(f"default {_label(default)}", default, default_splits)]
    if tune:
        changed = [replace(default, **change) for change in TUNE_CHANGES]
        launches += [(_label(settings), settings, default_splits)
                     for settings in dict.fromkeys(changed) if settings != default]
        launches += [(f"num_splits={splits}", default, splits)
                     for splits in sorted({max(1, default_splits // 2), default_splits * 2} - {default_splits})]
    default_us = None
    for label, settings, splits in launches:

        def call(layer, settings=settings, splits=splits):
            return launch(q4, cache, layer, tables, lens, KV_LORA_RANK, SCALE, splits, settings)

        try:
            error = float((call(0).view(ref.shape).double() - ref).norm() / ref.norm())
            us = graph_us([lambda layer=layer: call(layer) for layer in range(LAYERS)], device)
        except OutOfResources as failure:  # a setting whose tiles do not fit the device's shared memory
            print(f"{label}: failed, {type(failure).__name__}: {str(failure)[:200]}", flush=True)
            continue
        baseline, base_us = ("torch", baseline_us) if default_us is None else ("default", default_us)
        default_us = default_us or us
        yield dict(shape=f"{batch}x{context}", heads=num_heads, cache=cache_name, setting=label, splits=splits,
                   bytes=moved, kernel_us=us, gbps=moved / us / 1e3, of_bandwidth=moved / (us / 1e6) / bandwidth,
                   rel_error=error, baseline=baseline, baseline_us=base_us, speedup=base_us / us)


def append_json(path: str, row: dict) -> None:
    """`row` as one JSON line at the end of `path`, with the machine, the command and the date."""
    with open(path, "a") as f:
        f.write(json.dumps({**row, "machine": machine(), "command": " ".join(sys.argv), "date": str(date.today())})
                + "\n")


def prefill_main(args, device) -> None:
    rate = matmul_rate()
    print(f"{machine()}; bf16 matrix products {rate / 1e12:,.0f} TFLOP/s")
    print(f"{'tokens':>6} {'heads':>5} {'cache':>5} {'setting':>22} {'TFLOP':>7} {'us':>9} {'TFLOP/s':>8} "
          f"{'of rate':>7} {'rel err':>8} {'baseline':>8} {'base us':>9} {'speedup':>8}")
    for num_heads in args.heads:
        for cache_name in ["bf16", "fp8"] if args.cache_dtype == "both" else [args.cache_dtype]:
            for row in prefill_rows(num_heads, cache_name, rate, args.tune, device):
                print(f"{row['tokens']:>6} {row['heads']:>5} {row['cache']:>5} {row['setting']:>22} "
                      f"{row['flops'] / 1e12:7.2f} {row['kernel_us']:9.1f} {row['tflops']:8.1f} {row['of_rate']:7.3f} "
                      f"{row['rel_error']:8.1e} {row['baseline']:>8} {row['baseline_us']:9.1f} "
                      f"{row['speedup']:7.2f}x", flush=True)
                if args.json:
                    append_json(args.json, row)


def prefill_rows(num_heads: int, cache_name: str, rate: float, tune: bool, device):
    """`case_rows` for one fresh prompt of PROMPT_TOKENS tokens through kernels/mla_prefill.py."""
    from dataclasses import replace

    import torch
    from triton.runtime.errors import OutOfResources

    from spillway.kernels.mla_prefill import default_prefill_settings, launch, paged_mla_prefill_reference
    from spillway.tools.bench.kernels.moe_cases import graph_us

    tokens = PROMPT_TOKENS
    _, cache, tables, lens = build_case(1, tokens, num_heads, cache_name, device)
    q = torch.randn(tokens, num_heads, ROW_DIM, dtype=torch.bfloat16, device=device)
    starts = torch.tensor([0, tokens], dtype=torch.int32, device=device)
    args = (q, cache, 0, starts, lens, tables)
    kwargs = dict(kv_lora_rank=KV_LORA_RANK, scale=SCALE, max_query_len=tokens)
    flops = 2 * (ROW_DIM + KV_LORA_RANK) * num_heads * tokens * (tokens + 1) // 2
    ref = paged_mla_prefill_reference(*args, **kwargs).double()
    baseline_us = 1e3 * bench_ms(lambda: paged_mla_prefill_reference(*args, **kwargs), warmup=2, rep=10)
    default = default_prefill_settings(num_heads, tokens, cache.dtype)
    launches = [(f"default {_label(default)}", default)]
    if tune:
        changed = dict.fromkeys(replace(default, **change) for change in TUNE_CHANGES)
        launches += [(_label(settings), settings) for settings in changed if settings != default]
    default_us = None
    for label, settings in launches:

        def call(layer, settings=settings):
            return launch(q, cache, layer, starts, lens, tables, KV_LORA_RANK, SCALE, tokens, settings)

        try:
            error = float((call(0).double() - ref).norm() / ref.norm())
            us = graph_us([lambda layer=layer: call(layer) for layer in range(LAYERS)], device)
        except OutOfResources as failure:
            print(f"{label}: failed, {type(failure).__name__}: {str(failure)[:200]}", flush=True)
            continue
        baseline, base_us = ("torch", baseline_us) if default_us is None else ("default", default_us)
        default_us = default_us or us
        yield dict(tokens=tokens, heads=num_heads, cache=cache_name, setting=label, flops=flops, kernel_us=us,
                   tflops=flops / us / 1e6, of_rate=flops / (us / 1e6) / rate, rel_error=error, baseline=baseline,
                   baseline_us=base_us, speedup=base_us / us)


def _label(settings) -> str:
    """`settings` as `m16,n32,w4,s3`: rows and tokens a program, warps, stages."""
    return "m{block_m},n{block_n},w{num_warps},s{num_stages}".format(**asdict(settings))


def build_case(batch: int, context: int, num_heads: int, cache_name: str, device):
    """q `[batch, heads, 576]` bf16, a latent cache of LAYERS layers (bf16, or float8 as
    kernels/fp8.py writes it), int32 block tables of shuffled blocks, int32 context lengths."""
    import torch

    from spillway.kernels.fp8 import FP8_E4M3, to_cache_dtype_reference

    generator = torch.Generator().manual_seed(0)
    width = -(-context // BLOCK_SIZE)
    tables = torch.randperm(batch * width, generator=generator).to(torch.int32).view(batch, width).to(device)
    cache = torch.randn(batch * width, LAYERS, 1, BLOCK_SIZE, 1, ROW_DIM, dtype=torch.bfloat16, device=device)
    if cache_name == "fp8":
        cache = to_cache_dtype_reference(cache, FP8_E4M3)
    q = torch.randn(batch, num_heads, ROW_DIM, dtype=torch.bfloat16, device=device)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    return q, cache, tables, lens


if __name__ == "__main__":
    main()
