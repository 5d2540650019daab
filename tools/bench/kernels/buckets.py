"""What a step's padding rows cost: the decoder's matrix products at a step's token count and at
the token bucket whose graph it replays (worker/runner/cuda_graphs.py), on the GPU.

A prefill, mixed or cascade step of n tokens runs the graph of the smallest bucket >= n, its
rows past n padded. Each row of the table times one decoder layer's products (qkv, o, gate_up,
down; bf16, weights stored input-major as the engine stores them) at n rows, at this tree's
bucket for n and, with `--other-buckets`, at another bucket list's, and gives the step's cost
of them (x num_layers) in each.

    python tools/bench/kernels/buckets.py                                   # qwen3-8b, 144..512 tokens
    python tools/bench/kernels/buckets.py --tokens 200,300 --other-buckets 16,32,64,96,128,192,256,384,512
    python tools/bench/kernels/buckets.py --layouts --tokens 1,16,208,512,2048

`--layouts` times each product alone at each row count with its weight stored both ways:
input-major (the engine's storage on a GPU, worker/models/gpu_linear.py) and output-major
(`nn.Linear`'s, `SPILLWAY_INPUT_MAJOR_WEIGHTS=0`): cuBLAS picks its kernels by layout and shape.
"""

from __future__ import annotations

import argparse
import json
import sys

from spillway.tools.bench.ceilings import bench_ms, machine  # noqa: E402

DEFAULT_TOKENS = (144, 176, 200, 232, 264, 300, 360, 420, 480)


def builtin_config(config_name: str) -> dict:
    from spillway.protocol.local.model_files import BUILTIN_CONFIGS_DIR

    return json.loads((BUILTIN_CONFIGS_DIR / f"{config_name}.json").read_text())


def layer_shapes(config_name: str, config: dict | None = None) -> list[tuple[int, int]]:
    """(in, out) of one decoder layer's products for a built-in config (`config`: it, read already)."""
    config = config or builtin_config(config_name)
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    kv_heads = config.get("num_key_value_heads") or heads
    inter = config["intermediate_size"]
    return [(hidden, (heads + 2 * kv_heads) * head_dim), (heads * head_dim, hidden), (hidden, 2 * inter), (inter, hidden)]


def bucket_of(tokens: int, buckets: tuple[int, ...] | list[int]) -> int | None:
    """The smallest bucket >= tokens; None past the last (the step runs eagerly)."""
    return next((bucket for bucket in sorted(buckets) if bucket >= tokens), None)


PRODUCTS = ("qkv", "o", "gate_up", "down")  # layer_shapes' order


def product_weight(n_in: int, n_out: int, input_major: bool, device="cuda", dtype=None) -> torch.Tensor:
    """An `[out, in]` weight for `F.linear` (bf16 unless `dtype`): stored `[in, out]` row-major
    (input-major, as worker/models/gpu_linear.py stores them) or `[out, in]` row-major (output-major)."""
    import torch

    weight = torch.randn(n_out, n_in, device=device, dtype=dtype or torch.bfloat16)
    return weight.t().contiguous().t() if input_major else weight


def layer_ms(shapes: list[tuple[int, int]], rows: int, cache: dict[int, float]) -> float:
    """Milliseconds of one layer's products at `rows` rows (measured once per row count)."""
    import torch

    if rows not in cache:
        weights = [product_weight(n_in, n_out, True) for n_in, n_out in shapes]
        inputs = [torch.randn(rows, n_in, device="cuda", dtype=torch.bfloat16) for n_in, _ in shapes]

        def products() -> None:
            for x, w in zip(inputs, weights):
                torch.nn.functional.linear(x, w)

        cache[rows] = bench_ms(products)
    return cache[rows]


def print_layouts(shapes: list[tuple[int, int]], tokens: list[int]) -> None:
    """Each product at each row count, input-major against output-major, one after the other."""
    import torch

    print(" | ".join(["rows", "product", "in x out", "input-major us", "output-major us", "output / input"]))
    for rows in tokens:
        for name, (n_in, n_out) in zip(PRODUCTS, shapes):
            x = torch.randn(rows, n_in, device="cuda", dtype=torch.bfloat16)
            flops = 2 * rows * n_in * n_out
            times = []
            for input_major in (True, False):
                weight = product_weight(n_in, n_out, input_major)
                times.append(bench_ms(lambda: torch.nn.functional.linear(x, weight)) * 1e3)
                del weight
            cells = [f"{us:.1f} ({flops / us / 1e6:.0f} TFLOP/s)" for us in times]
            print(" | ".join([str(rows), name, f"{n_in} x {n_out}", *cells, f"{times[1] / times[0]:.3f}"]))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-8b", help="a built-in config")
    parser.add_argument("--tokens", default=",".join(map(str, DEFAULT_TOKENS)), help="step sizes, comma-separated")
    parser.add_argument("--other-buckets", help="another bucket list to compare, comma-separated")
    parser.add_argument("--layouts", action="store_true",
                        help="each product alone at each row count, input-major against output-major weights")
    args = parser.parse_args(argv)
    import torch

    from spillway.worker.runner.cuda_graphs import PREFILL_TOKEN_BUCKETS

    tokens = [int(value) for value in args.tokens.split(",")]
    if any(value < 1 for value in tokens):
        parser.error("--tokens takes positive step sizes")
    other = [int(value) for value in args.other_buckets.split(",")] if args.other_buckets else None
    if not torch.cuda.is_available():
        sys.exit("tools/bench/kernels/buckets.py times the products on a GPU; none is visible")
    config = builtin_config(args.model)
    num_layers = config["num_hidden_layers"]
    shapes = layer_shapes(args.model, config)
    flops_per_row = 2 * sum(n_in * n_out for n_in, n_out in shapes) * num_layers
    print(machine())
    if args.layouts:
        print(f"{args.model}: one layer's products, each alone, us (medians)")
        print_layouts(shapes, tokens)
        return
    print(f"{args.model}: {num_layers} layers of products {shapes}; ms a step (x {num_layers} layers)")
    header = ["tokens", "at n rows", "bucket", "at bucket", "bucket / n"]
    if other:
        header += ["other bucket", "at it", "other / this"]
    print(" | ".join(header))
    cache: dict[int, float] = {}
    for n in tokens:
        exact = layer_ms(shapes, n, cache) * num_layers
        row = [f"{n}", f"{exact:.2f} ({flops_per_row * n / exact / 1e9:.0f} TFLOP/s)"]
        bucket = bucket_of(n, PREFILL_TOKEN_BUCKETS)
        at_bucket = layer_ms(shapes, bucket, cache) * num_layers if bucket else None
        row += [str(bucket or "eager"), f"{at_bucket:.2f}" if at_bucket else "-",
                f"{at_bucket / exact:.3f}" if at_bucket else "-"]
        if other:
            other_bucket = bucket_of(n, other)
            at_other = layer_ms(shapes, other_bucket, cache) * num_layers if other_bucket else None
            row += [str(other_bucket or "eager"), f"{at_other:.2f}" if at_other else "-",
                    f"{at_other / at_bucket:.3f}" if at_other and at_bucket else "-"]
        print(" | ".join(row))


if __name__ == "__main__":
    main()
