"""The decode attention kernel alone on the GPU, over shapes the engine meets, each launch
setting beside the others in the same run and against the read bandwidth measured here.

    python tools/bench/kernels/attention.py                      # bf16 and fp8 caches, both loop structures
    python tools/bench/kernels/attention.py --cache-dtype fp8 --shapes 512x1000-2000
    python tools/bench/kernels/attention.py --extend 32x4128,64x4160,32x32800   # prefill kernel, key splits

    python tools/bench/kernels/attention.py --convoy                # 50x4@10000: cascade vs prefill kernel
    python tools/bench/kernels/attention.py --convoy --tune         # cascade's tiles, warps, stages, splits

`--extend NEWxCONTEXT`: the prefill kernel on one sequence's NEW tokens after a cached prefix
(CONTEXT tokens in all), bf16 cache, with 1, 2, 4, 8 and 16 key splits against 1.

`--convoy SEQSxNEW@PREFIX` (default 50x4@10000): SEQS sequences of NEW new tokens each, after
PREFIX tokens in the same blocks and 0-15 cached tokens of their own, bf16 cache, one layer:
cascade attention (the split count an eager step picks, the one a prefill graph's cascade
twin picks for the step's token bucket, then 1, 2, 4, 8, 16) against the prefill kernel as an
eager step runs it (1 split), with the KV bytes each reads and the host time of finding the
shared prefix.

A shape is BATCHxCONTEXT or BATCHxLOW-HIGH (contexts drawn uniformly, seed 0); Qwen3-8B heads
(32 query, 8 KV heads of 128), blocks of 16 tokens in shuffled order. Bytes counted are the
keys and values of every context token; the ratio column is each row's time against the
launcher's default for the same shape and cache.
"""

from __future__ import annotations

import argparse


from spillway.tools.bench.ceilings import bench_ms, machine, read_bandwidth  # noqa: E402

DEFAULT_SHAPES = "64x4096,512x1000-2000,200x1040"
BLOCK_SIZE = 16


def parse_shape(text: str) -> tuple[int, int, int]:
    """`(batch, low, high)` of `BATCHxCONTEXT` or `BATCHxLOW-HIGH`."""
    try:
        batch, contexts = text.split("x")
        low, _, high = contexts.partition("-")
        shape = int(batch), int(low), int(high or low)
    except ValueError:
        raise argparse.ArgumentTypeError(f"shape {text!r} is not BATCHxCONTEXT or BATCHxLOW-HIGH") from None
    if not (shape[0] > 0 and 0 < shape[1] <= shape[2]):
        raise argparse.ArgumentTypeError(f"shape {text!r}: batch and contexts must be positive, LOW <= HIGH")
    return shape


def parse_shapes(text: str) -> list[tuple[int, int, int]]:
    return [parse_shape(part) for part in text.split(",")]


def parse_convoy(text: str) -> tuple[int, int, int]:
    """`(seqs, new, prefix)` of `SEQSxNEW@PREFIX`; PREFIX whole blocks of 16 tokens."""
    try:
        counts, prefix = text.split("@")
        seqs, new = counts.split("x")
        shape = int(seqs), int(new), int(prefix)
    except ValueError:
        raise argparse.ArgumentTypeError(f"convoy {text!r} is not SEQSxNEW@PREFIX") from None
    if not (shape[0] >= 2 and shape[1] > 0 and shape[2] > 0 and shape[2] % BLOCK_SIZE == 0):
        raise argparse.ArgumentTypeError(f"convoy {text!r}: SEQS >= 2, NEW > 0, PREFIX a positive multiple "
                                         f"of {BLOCK_SIZE} (the block size)")
    return shape


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", type=parse_shapes, default=DEFAULT_SHAPES,
                        help="comma-separated BATCHxCONTEXT or BATCHxLOW-HIGH")
    parser.add_argument("--cache-dtype", choices=["bf16", "fp8", "both"], default="both")
    parser.add_argument("--extend", type=parse_shapes, help="comma-separated NEWxCONTEXT: the prefill kernel")
    parser.add_argument("--convoy", type=parse_convoy, nargs="?", const=parse_convoy("50x4@10000"),
                        help="SEQSxNEW@PREFIX (default 50x4@10000): cascade attention vs the prefill kernel")
    parser.add_argument("--tune", action="store_true", help="with --convoy: sweep cascade attention's tiles, "
                        "warps, stages and splits against its defaults")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("tools/bench/kernels/attention.py needs a CUDA GPU")
    if args.convoy:
        from spillway.tools.bench.kernels.convoy import bench_convoy, tune_convoy

        (tune_convoy if args.tune else bench_convoy)(*args.convoy)
        return
    if args.extend:
        bench_extend(args.extend)
        return
    from spillway.kernels.paged_attention_decode import launch

    cache_dtypes = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}

    heads, kv_heads, head_dim, block_size = 32, 8, 128, 16
    bandwidth = read_bandwidth()
    print(f"{machine()}; read bandwidth {bandwidth / 1e9:,.1f} GB/s")
    print(f"{'shape':>16} {'cache':>5} {'loops':>17} {'us':>9} {'GB/s':>9} {'of bw':>6} {'speed vs default':>16}")
    generator = torch.Generator().manual_seed(0)
    for batch, low, high in args.shapes:
        lens = torch.randint(low, high + 1, (batch,), generator=generator, dtype=torch.int32)
        width = -(-high // block_size)
        tables = torch.randperm(batch * width, generator=generator).to(torch.int32).view(batch, width).cuda()
        context_lens = lens.cuda()
        q = torch.randn(batch, 1, heads, head_dim, dtype=torch.bfloat16, device="cuda")
        names = ["bf16", "fp8"] if args.cache_dtype == "both" else [args.cache_dtype]
        for name in names:
            cache = torch.randn(batch * width, 1, 2, block_size, kv_heads, head_dim, dtype=torch.bfloat16,
                                device="cuda").to(cache_dtypes[name])
            kv_bytes = int(lens.sum()) * kv_heads * head_dim * 2 * cache.element_size()
            default_us = None
            for one_loop, label in ((False, "two (default)"), (True, "one masked loop")):
                us = 1e3 * bench_ms(lambda: launch(q, cache, 0, tables, context_lens, head_dim**-0.5, None,
                                                   one_loop=one_loop))
                default_us = default_us or us
                achieved = kv_bytes / (us / 1e6)
                shape = f"{batch}x{low}" + (f"-{high}" if high != low else "")
                print(f"{shape:>16} {name:>5} {label:>17} {us:9.1f} {achieved / 1e9:9.1f} "
                      f"{achieved / bandwidth:6.3f} {default_us / us:15.3f}x")
            del cache
            torch.cuda.empty_cache()


def bench_extend(shapes: list[tuple[int, int, int]]) -> None:
    import torch

    from spillway.kernels.paged_attention_prefill import paged_prefill_attention

    heads, kv_heads, head_dim, block_size = 32, 8, 128, 16
    print(f"{machine()}; prefill kernel, one sequence, Qwen3-8B heads, bf16 cache")
    print(f"{'new x context':>16} {'splits':>6} {'us':>9} {'speed vs 1 split':>16}")
    generator = torch.Generator().manual_seed(0)
    for new, context, _ in shapes:
        width = -(-context // block_size)
        tables = torch.randperm(width, generator=generator).to(torch.int32).view(1, width).cuda()
        cache = torch.randn(width, 1, 2, block_size, kv_heads, head_dim, dtype=torch.bfloat16, device="cuda")
        q = torch.randn(new, heads, head_dim, dtype=torch.bfloat16, device="cuda")
        starts = torch.tensor([0, new], dtype=torch.int32, device="cuda")
        lens = torch.tensor([context], dtype=torch.int32, device="cuda")
        base = None
        for splits in (1, 2, 4, 8, 16):
            us = 1e3 * bench_ms(lambda: paged_prefill_attention(q, cache, 0, starts, lens, tables, head_dim**-0.5,
                                                                new, splits))
            base = base or us
            print(f"{f'{new}x{context}':>16} {splits:>6} {us:9.1f} {base / us:15.3f}x")
        del cache
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
