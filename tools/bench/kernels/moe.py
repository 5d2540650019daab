"""The fused mixture-of-experts kernel on the GPU against its roofline and the plain-torch experts.

    python tools/bench/kernels/moe.py                                   # Qwen3-30B-A3B and Mixtral, bf16
    python tools/bench/kernels/moe.py --shapes qwen3-30b-a3b --tokens 1,8,64
    python tools/bench/kernels/moe.py --json /tmp/moe.jsonl             # also one JSON line a row
    python tools/bench/kernels/moe.py --fp8-weights                     # fp8 experts against bf16 ones

Each row: T tokens routed by softmax top-k over random logits (seed fixed), the kernel's
microseconds a call as CUDA graph replays over several copies of the weights, each with its own
routing (a model's layers: each call reads its experts from memory, not L2;
tools/bench/kernels/moe_cases.py), with the tiles kernels/moe_config.py picks for this GPU;
the experts a call touches (on average over the copies); the bytes it must move (those
experts' weights, its input and output) and its FLOPs; the byte bound (bytes over the read
bandwidth measured in this run, tools/bench/ceilings.py) and the FLOP bound (FLOPs over the
bf16 matrix-product rate measured in this run); the fraction of the roofline (the larger
bound) the kernel reaches; and the baseline, worker/models/layers.py's `fused_experts` (plain
torch, expert by expert, with host syncs, so timed eagerly) on the same inputs, with the
kernel's speedup over it.

With --fp8-weights the kernel runs the experts in float8 e4m3fn with a float32 scale per output
row (as `--quantization fp8` holds them; bf16 activations), the bytes count a byte a weight and
the scales, and the baseline is the kernel on the same experts in bf16, measured in the same run.

Shapes: qwen3-30b-a3b (128 experts, H 2048, I 768, top 8), mixtral-8x7b (8 experts, H 4096,
I 14336, top 2).
"""

from __future__ import annotations

import argparse
import json
import sys


from spillway.tools.bench.kernels.moe_cases import SHAPES, MoeShape  # noqa: E402

DEFAULT_TOKENS = "1,8,64,256,1024,4096"


def parse_tokens(text: str) -> list[int]:
    try:
        tokens = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"tokens {text!r} are not comma-separated integers") from None
    if not tokens or min(tokens) < 1:
        raise argparse.ArgumentTypeError(f"tokens {text!r} must be positive")
    return tokens


def parse_shapes(text: str) -> list[MoeShape]:
    unknown = [name for name in text.split(",") if name not in SHAPES]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown shapes {unknown}; known: {', '.join(SHAPES)}")
    return [SHAPES[name] for name in text.split(",")]


def roofline_row(shape: MoeShape, num_tokens: int, kernel_us: float, baseline_us: float, distinct: float,
                 element_size: int, bandwidth: float, matmul_rate: float, fp8_weights: bool = False) -> dict:
    """One row's figures from its measurements and the machine's ceilings (bytes/s, FLOP/s)."""
    from spillway.tools.bench.kernels.moe_cases import flops, traffic_bytes

    moved = traffic_bytes(shape, num_tokens, distinct, element_size, fp8_weights)
    work = flops(shape, num_tokens)
    byte_bound_us, flop_bound_us = 1e6 * moved / bandwidth, 1e6 * work / matmul_rate
    return dict(shape=shape.name, tokens=num_tokens, kernel_us=kernel_us, experts=distinct, bytes=moved, flops=work,
                byte_bound_us=byte_bound_us, flop_bound_us=flop_bound_us,
                of_roofline=max(byte_bound_us, flop_bound_us) / kernel_us,
                baseline_us=baseline_us, speedup=baseline_us / kernel_us)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", type=parse_shapes, default=list(SHAPES.values()),
                        help=f"comma-separated, of {', '.join(SHAPES)} (default both)")
    parser.add_argument("--tokens", type=parse_tokens, default=parse_tokens(DEFAULT_TOKENS),
                        help=f"token counts T (default {DEFAULT_TOKENS})")
    parser.add_argument("--json", help="append each row to this file as a JSON line")
    parser.add_argument("--fp8-weights", action="store_true",
                        help="fp8 experts (row scales), against the kernel on bf16 experts")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("tools/bench/kernels/moe.py needs a CUDA GPU")
    from spillway.tools.bench.ceilings import machine, matmul_rate, read_bandwidth

    bandwidth, rate = read_bandwidth(), matmul_rate()
    print(f"{machine()}; read bandwidth {bandwidth / 1e9:,.0f} GB/s, bf16 matmul {rate / 1e12:,.0f} TFLOP/s")
    baseline = "bf16 us" if args.fp8_weights else "torch us"
    print(f"{'shape':>14} {'T':>5} {'kernel us':>10} {'experts':>8} {'MB':>9} {'GFLOP':>8} {'byte us':>8} "
          f"{'flop us':>8} {'of roof':>7} {baseline:>9} {'speedup':>8}")
    for shape in args.shapes:
        rows = fp8_shape_rows if args.fp8_weights else shape_rows
        for row in rows(shape, args.tokens, bandwidth, rate):
            print(f"{row['shape']:>14} {row['tokens']:>5} {row['kernel_us']:10.1f} {row['experts']:8.1f} "
                  f"{row['bytes'] / 1e6:9.1f} {row['flops'] / 1e9:8.2f} {row['byte_bound_us']:8.1f} "
                  f"{row['flop_bound_us']:8.1f} {row['of_roofline']:7.3f} {row['baseline_us']:9.1f} "
                  f"{row['speedup']:7.2f}x", flush=True)
            if args.json:
                with open(args.json, "a") as f:
                    f.write(json.dumps({**row, "machine": machine(), "command": " ".join(sys.argv)}) + "\n")


def shape_rows(shape: MoeShape, token_counts: list[int], bandwidth: float, rate: float):
    import torch

    from spillway.kernels.fused_moe import fused_experts
    from spillway.worker.models import layers as model_layers
    from spillway.tools.bench.ceilings import bench_ms
    from spillway.tools.bench.kernels import moe_cases

    dtype, device = torch.bfloat16, torch.device("cuda")
    free, _ = torch.cuda.mem_get_info()
    copies = moe_cases.layer_copies(shape, 2, torch.cuda.get_device_properties(device).L2_cache_size, int(free * 0.4))
    weights = [moe_cases.expert_weights(shape, dtype, device, seed) for seed in range(copies)]
    for num_tokens in token_counts:
        layers = moe_cases.layers_for(shape, weights, num_tokens, dtype, device)
        kernel_us = moe_cases.graph_us([lambda layer=layer: fused_experts(*layer.args()) for layer in layers], device)

        def baseline():
            for layer in layers:
                model_layers.fused_experts(*layer.args())

        baseline_us = 1e3 * bench_ms(baseline, warmup=10, rep=100) / len(layers)
        yield roofline_row(shape, num_tokens, kernel_us, baseline_us, moe_cases.distinct_experts(layers), 2,
                           bandwidth, rate)
    del weights
    torch.cuda.empty_cache()


def fp8_shape_rows(shape: MoeShape, token_counts: list[int], bandwidth: float, rate: float):
    """The rows of fp8 experts, the baseline the kernel on the same experts in bf16."""
    import torch

    from spillway.kernels.fused_moe import fused_experts
    from spillway.tools.bench.kernels import moe_cases

    dtype, device = torch.bfloat16, torch.device("cuda")
    free, _ = torch.cuda.mem_get_info()
    # Copies enough for the fp8 calls to overflow L2; each holds bf16 and fp8 weights, 3 bytes a weight.
    l2_bytes = torch.cuda.get_device_properties(device).L2_cache_size
    copies = moe_cases.layer_copies(shape, 1, l2_bytes, int(free * 0.4) // 3)
    weights = [moe_cases.expert_weights(shape, dtype, device, seed) for seed in range(copies)]
    fp8_weights = [moe_cases.fp8_expert_weights(w13, w2) for w13, w2 in weights]
    for num_tokens in token_counts:
        timed = []
        for stacks in (fp8_weights, weights):
            layers = moe_cases.layers_for(shape, stacks, num_tokens, dtype, device)
            timed.append(moe_cases.graph_us([lambda layer=layer: fused_experts(*layer.args(), **layer.scales())
                                             for layer in layers], device))
        yield roofline_row(shape, num_tokens, timed[0], timed[1], moe_cases.distinct_experts(layers), 2,
                           bandwidth, rate, fp8_weights=True)
    del weights, fp8_weights
    torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
