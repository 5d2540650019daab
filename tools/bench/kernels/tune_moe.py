"""Tune the fused mixture-of-experts kernel's tiles for one shape on this GPU and write its table.

    python tools/bench/kernels/tune_moe.py --experts 128 --hidden 2048 --intermediate 768 --topk 8 --dtype bf16
    python tools/bench/kernels/tune_moe.py --experts 8 --hidden 4096 --intermediate 14336 --topk 2 --batches 1,64
    python tools/bench/kernels/tune_moe.py --dry-run --out /tmp/tiny.json    # any machine: Triton's interpreter
    python tools/bench/kernels/tune_moe.py --fp8-weights                     # the experts of --quantization fp8

The table goes to kernels/moe_configs/ under the name kernels/moe_config.py reads for this
GPU (or to --out), one entry per batch size T, written after each T (a run cut short keeps
the sizes it finished; a table already there for the same shape keeps the sizes not tuned again). For each T, with softmax top-k routing of
random logits (seeded): every candidate is checked once against worker/models/layers.py's
`fused_experts` (plain torch) and then timed as CUDA graph replays of calls over several
copies of the weights, as a model's layers read them (tools/bench/kernels/moe_cases.py).

The search is pruned in two rounds. Round one: tile shapes with common warps and stages (the
pairs path's column and reduction tiles while experts get a few pairs each; the grouped path's
BLOCK_SIZE_M sized to the pairs an expert gets, BLOCK_SIZE_N and BLOCK_SIZE_K within shared
memory). Round two: the best of round one with its warps, stages and GROUP_SIZE_M varied one at a
time. The untuned default (kernels/moe_config.py's `default_config`) is a candidate too, and each
row prints its time beside the best's, measured in the same run.

`--fp8-weights` tunes the experts in float8 e4m3fn with a float32 scale per output row (as an FP8
model holds them) for their own table, `...-bf16-fp8weights.json`.

`--dry-run` runs all of it on a tiny shape (4 experts, H 48, I 40, top 2, T 1 and 5, float32)
with two candidates besides the default, through Triton's interpreter on the CPU, timing one pass of each.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import date
from pathlib import Path


from spillway.tools.bench.kernels.moe_cases import MoeShape  # noqa: E402

DEFAULT_BATCHES = "1,2,4,8,16,32,64,128,256,512,1024,2048,4096"
DTYPES = ("bf16", "fp16", "fp32")
TOLERANCE = {"bf16": 2e-2, "fp16": 1e-2, "fp32": 1e-4}
SHARED_MEMORY_BUDGET = 200 * 1024  # bytes of a Hopper SM's 227 KiB a program's stages may take
DRY_RUN_SHAPE = MoeShape("tiny", 4, 48, 40, 2)
DRY_RUN_BATCHES = "1,5"


def parse_batches(text: str) -> list[int]:
    try:
        batches = sorted({int(part) for part in text.split(",")})
    except ValueError:
        raise argparse.ArgumentTypeError(f"batches {text!r} are not comma-separated integers") from None
    if not batches or batches[0] < 1:
        raise argparse.ArgumentTypeError(f"batches {text!r} must be positive")
    return batches


def shared_bytes(block_m: int, block_n: int, block_k: int, stages: int, element_size: int) -> int:
    """Shared memory of the grouped gate/up program (the larger): a row tile and two weight tiles a stage."""
    return (block_m * block_k + 2 * block_k * block_n) * element_size * stages


def round_one(num_tokens: int, shape: MoeShape, element_size: int) -> list:
    """Tile shapes at common warps and stages."""
    from spillway.kernels.moe_config import MoeConfig

    pairs_per_expert = num_tokens * shape.top_k / shape.num_experts
    found = []
    if pairs_per_expert <= 4:
        # Tiles past 16K elements a program spill registers (sm_90, 8 warps).
        found += [MoeConfig("pairs", block_size_n=block_n, block_size_k=block_k,
                            num_warps=4 if block_n * block_k <= 8192 else 8, num_stages=2)
                  for block_n in (16, 32, 64) for block_k in (128, 256, 512, 1024) if block_n * block_k <= 16384]
    high = min(128, max(16, 1 << (max(1, round(pairs_per_expert)) - 1).bit_length()))
    for block_m in (m for m in (16, 32, 64, 128) if max(16, high // 4) <= m <= high):
        for block_n in (32, 64, 128, 256):
            for block_k in (64, 128):
                stages = deepest_stages(block_m, block_n, block_k, element_size)
                if block_m * block_n > 128 * 256 or stages is None:
                    continue
                found.append(MoeConfig("grouped", block_m, block_n, block_k, group_size_m=8,
                                       num_warps=8 if block_m * block_n >= 128 * 128 else 4, num_stages=stages))
    return found


def deepest_stages(block_m: int, block_n: int, block_k: int, element_size: int) -> int | None:
    """3 stages where they fit in shared memory, else 2 (large prefill tiles, which a fixed 3
    would leave out of the search), None where not even 2 do."""
    for stages in (3, 2):
        if shared_bytes(block_m, block_n, block_k, stages, element_size) <= SHARED_MEMORY_BUDGET:
            return stages
    return None


def round_two(best, element_size: int) -> list:
    """The best config with its warps, stages and GROUP_SIZE_M varied one at a time."""
    from dataclasses import replace

    variants = [replace(best, num_warps=warps) for warps in (2, 4, 8) if warps != best.num_warps]
    variants += [replace(best, num_stages=stages) for stages in (1, 2, 3, 4, 5) if stages != best.num_stages
                 and shared_bytes(best.block_size_m, best.block_size_n, best.block_size_k, stages,
                                  element_size) <= SHARED_MEMORY_BUDGET]
    if best.path == "grouped":
        variants += [replace(best, group_size_m=group) for group in (1, 16) if group != best.group_size_m]
    return variants


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experts", type=int, default=128, help="E (default 128: Qwen3-30B-A3B)")
    parser.add_argument("--hidden", type=int, default=2048, help="H")
    parser.add_argument("--intermediate", type=int, default=768, help="I, each expert's width")
    parser.add_argument("--topk", type=int, default=8, help="K, experts per token")
    parser.add_argument("--dtype", choices=DTYPES, help="default bf16 (fp32 with --dry-run: the interpreter "
                                                         "multiplies bf16 tiles wrongly)")
    parser.add_argument("--batches", type=parse_batches, default=None, help=f"token counts (default {DEFAULT_BATCHES})")
    parser.add_argument("--out", help="the table's path (default: kernels/moe_configs/ under this GPU's name; "
                                      "with --dry-run, printed only)")
    parser.add_argument("--dry-run", action="store_true", help="tiny shape, two candidates, interpreter on the CPU")
    parser.add_argument("--fp8-weights", action="store_true", help="fp8 experts with row scales (their own table)")
    args = parser.parse_args()
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported
    shape = DRY_RUN_SHAPE if args.dry_run else \
        MoeShape("tuned", args.experts, args.hidden, args.intermediate, args.topk)
    if min(shape.num_experts, shape.hidden, shape.intermediate, shape.top_k) < 1:
        parser.error("--experts, --hidden, --intermediate and --topk must be positive")
    batches = args.batches or parse_batches(DRY_RUN_BATCHES if args.dry_run else DEFAULT_BATCHES)
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit("tools/bench/kernels/tune_moe.py needs a CUDA GPU (or --dry-run)")
    dtype = args.dtype or ("fp32" if args.dry_run else "bf16")
    Tuner(shape, dtype, torch.device("cpu" if args.dry_run else "cuda"), args.dry_run,
          args.fp8_weights).run(batches, args.out)


def earlier_buckets(path: Path | None, shape: dict) -> dict:
    """The buckets a table at `path` already holds for the same shape and device: a run over
    some batch sizes adds to them (and replaces those it tunes again) instead of dropping them."""
    if path is None or not path.exists():
        return {}
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise SystemExit(f"{path} exists but is not a table: {error}") from None
    if table.get("shape") != shape:
        print(f"{path} holds another shape ({table.get('shape')}): replacing it", flush=True)
        return {}
    print(f"{path}: keeping its {len(table['buckets'])} batch sizes not tuned again", flush=True)
    return dict(table["buckets"])


class Tuner:
    """One shape's search over every batch size, on weights allocated once."""

    def __init__(self, shape: MoeShape, dtype_name: str, device, dry_run: bool, fp8_weights: bool = False) -> None:
        import torch

        from spillway.tools.bench.kernels import moe_cases

        self.shape, self.dtype_name, self.device, self.dry_run = shape, dtype_name, device, dry_run
        self.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype_name]
        self.weight_dtype = torch.float8_e4m3fn if fp8_weights else self.dtype
        # Shared memory is sized at the activations' element size: an fp8 weight tile takes less.
        self.element_size = torch.empty((), dtype=self.dtype).element_size()
        weight_size = torch.empty((), dtype=self.weight_dtype).element_size()
        copies = 1
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info()
            l2_bytes = torch.cuda.get_device_properties(device).L2_cache_size
            copies = moe_cases.layer_copies(shape, weight_size, l2_bytes, int(free * 0.4))
        self.weights = [moe_cases.expert_weights(shape, self.dtype, device, seed) for seed in range(copies)]
        if fp8_weights:
            self.weights = [moe_cases.fp8_expert_weights(w13, w2) for w13, w2 in self.weights]

    def candidates(self, num_tokens: int) -> list:
        from spillway.kernels.moe_config import MoeConfig

        if self.dry_run:
            return [MoeConfig("pairs", block_size_n=16, block_size_k=32),
                    MoeConfig("grouped", block_size_m=16, block_size_n=16, block_size_k=16)]
        return round_one(num_tokens, self.shape, self.element_size)

    def run(self, batches: list[int], out: str | None) -> None:
        from spillway.kernels.moe_config import CONFIG_DIR, config_file_name, device_name
        from spillway.tools.bench.ceilings import machine

        started = time.perf_counter()
        fp8 = self.weight_dtype != self.dtype
        print(f"{machine()}; E {self.shape.num_experts}, H {self.shape.hidden}, I {self.shape.intermediate}, "
              f"top {self.shape.top_k}, {self.dtype_name}{', fp8 weights' if fp8 else ''}, "
              f"{len(self.weights)} weight copies", flush=True)
        print(f"{'T':>6} {'best us':>9} {'default us':>10} {'speedup':>8} {'tried':>6}  best config", flush=True)
        shape = dict(experts=self.shape.num_experts, hidden=self.shape.hidden,
                     intermediate=self.shape.intermediate, topk=self.shape.top_k, dtype=self.dtype_name,
                     device=device_name(self.device), **({"weights": "fp8"} if fp8 else {}))
        path = None if out is None and self.dry_run else Path(out) if out else CONFIG_DIR / config_file_name(
            self.shape.num_experts, self.shape.intermediate, device_name(self.device), self.dtype, self.weight_dtype)
        buckets = earlier_buckets(path, shape)
        for num_tokens in batches:
            buckets[str(num_tokens)] = self.tune(num_tokens).to_json()
            table = {
                "shape": shape,
                "tuned_with": dict(command=" ".join(sys.argv), machine=machine(), date=date.today().isoformat()),
                "buckets": dict(sorted(buckets.items(), key=lambda item: int(item[0]))),
            }
            if path is not None:  # after every batch size: a run cut short keeps what it found
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps(table, indent=2) + "\n")
        print(f"tuned {len(batches)} batch sizes in {time.perf_counter() - started:.0f} s", flush=True)
        if path is None:
            print(json.dumps(table, indent=2))
        else:
            print(f"wrote {path} ({len(buckets)} batch sizes)")

    def tune(self, num_tokens: int):
        """The fastest correct config for `num_tokens`, after both rounds."""
        from spillway.kernels.moe_config import default_config
        from spillway.tools.bench.kernels.moe_cases import layers_for

        layers = layers_for(self.shape, self.weights, num_tokens, self.dtype, self.device)
        reference = self.reference(layers[0])
        default = default_config(num_tokens, self.shape.num_experts, self.shape.top_k, self.dtype)
        timed = {}
        for config in dict.fromkeys([default, *self.candidates(num_tokens)]):
            self.try_config(config, layers, reference, timed)
        if not timed:
            raise SystemExit(f"T={num_tokens}: no candidate ran correctly")
        if not self.dry_run:
            for config in round_two(min(timed, key=timed.get), self.element_size):
                if config not in timed:
                    self.try_config(config, layers, reference, timed)
        best = min(timed, key=timed.get)
        default_us = timed.get(default, float("nan"))
        print(f"{num_tokens:>6} {timed[best]:9.1f} {default_us:10.1f} {default_us / timed[best]:7.2f}x "
              f"{len(timed):>6}  {best.to_json()}", flush=True)
        return best

    def reference(self, layer):
        from spillway.worker.models import layers

        return layers.fused_experts(*layer.args(), **layer.scales())

    def try_config(self, config, layers, reference, timed: dict) -> float | None:
        """The config's microseconds a call, recorded in `timed`; None (and a line saying why)
        when it fails to run or its output is off the reference."""
        from spillway.kernels.fused_moe import fused_experts
        from spillway.tools.bench.kernels.moe_cases import graph_us

        try:
            out = fused_experts(*layers[0].args(), config=config, **layers[0].scales())
        except Exception as error:  # a tile that does not fit this GPU: out of shared memory or registers
            print(f"       skipped {config.to_json()}: {type(error).__name__}: {str(error)[:200]}", flush=True)
            return None
        error = float((out.float() - reference.float()).norm() / reference.float().norm().clamp_min(1e-30))
        if not error <= TOLERANCE[self.dtype_name]:
            print(f"       wrong   {config.to_json()}: relative error {error:.2e}", flush=True)
            return None
        calls = [lambda layer=layer: fused_experts(*layer.args(), config=config, **layer.scales()) for layer in layers]
        timed[config] = graph_us(calls, self.device)
        return timed[config]


if __name__ == "__main__":
    main()
