"""How far FP8 weights (`--quantization fp8`) move a model's next-token distributions.

    python tools/bench/engine/fp8_accuracy.py                          # SmolLM2-135M, CPU, float32
    python tools/bench/engine/fp8_accuracy.py --device cuda MODEL      # bfloat16 against FP8 on a GPU

Teacher-forced: one fixed token sequence (the first --tokens tokens of --text, by default the
Python language reference's topics that ship with the interpreter, in sorted order) goes through
the model twice, unquantized (float32 on the CPU, bfloat16 on CUDA) and with its projections in
FP8, each position's logits read. Printed: the share of positions whose top-1 token agrees, and
the mean KL divergence KL(reference || FP8) in nats. Record figures in docs/performance.md with
the command, machine and date printed here.
"""

from __future__ import annotations

import argparse
import math
import platform
import sys
from dataclasses import dataclass
from datetime import date

import torch

from spillway.protocol.local.model_files import load_tokenizer
from spillway.worker.models import loader
from spillway.worker.runner.executor import load_model
from spillway.worker.runner.model_runner import ChunkInput, ModelRunner

BLOCK_SIZE = 16


@dataclass(frozen=True, slots=True)
class Agreement:
    """Two runs' next-token distributions over the same positions."""

    positions: int
    top1_agreement: float  # share of positions with the same argmax
    mean_kl: float  # mean over positions of KL(reference || other), nats
    max_kl: float


def compare_logits(reference: torch.Tensor, other: torch.Tensor) -> Agreement:
    """`reference` and `other`: logits `[positions, vocab]` of the same positions."""
    reference_log_p = torch.log_softmax(reference.double(), dim=-1)
    other_log_p = torch.log_softmax(other.double(), dim=-1)
    kl = (reference_log_p.exp() * (reference_log_p - other_log_p)).sum(-1)
    same_top1 = reference.argmax(-1) == other.argmax(-1)
    return Agreement(reference.shape[0], float(same_top1.double().mean()), float(kl.mean()), float(kl.max()))


def teacher_forced_logits(model: torch.nn.Module, token_ids: list[int], *, device: torch.device,
                          dtype: torch.dtype) -> torch.Tensor:
    """float32 logits `[len(token_ids), vocab]`: each position's prediction of the next token,
    the whole sequence prefilled as one chunk of one step."""
    num_blocks = math.ceil(len(token_ids) / BLOCK_SIZE) + 1
    runner = ModelRunner(model, num_blocks=num_blocks, block_size=BLOCK_SIZE, device=device, dtype=dtype,
                         max_num_batched_tokens=max(len(token_ids), 8192))
    with torch.inference_mode():
        logits = runner.execute([ChunkInput(token_ids, 0, list(range(num_blocks)))],
                                logits_rows=list(range(len(token_ids))))
    return logits.float().cpu().clone()


def reference_text() -> str:
    """English technical prose that ships with every Python: its language reference's topics."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in sorted(topics))


def measure(model: str | None, token_ids: list[int], *, device: torch.device, dtype: torch.dtype) -> Agreement:
    """Load `model` unquantized and in FP8 on `device`, and compare their logits over `token_ids`."""
    files = loader.resolve_model(model)
    hf_config = loader.load_config(files)
    logits = {}
    for quantization in (None, "fp8"):
        loaded = load_model(hf_config, files, device=device, dtype=dtype, seed=0, quantization=quantization)
        logits[quantization] = teacher_forced_logits(loaded, token_ids, device=device, dtype=dtype)
        del loaded
    return compare_logits(logits[None], logits["fp8"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", help="a model folder or .gguf file (default: the embedded SmolLM2-135M)")
    parser.add_argument("--tokens", type=int, default=1000, help="positions compared (default %(default)s)")
    parser.add_argument("--text", metavar="FILE", help="the text to feed (default: Python's language reference)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default %(default)s)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"),
                        help="the reference's dtype (default: float32 on the CPU, bfloat16 on CUDA)")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("float32" if device.type == "cpu" else "bfloat16"))
    files = loader.resolve_model(args.model)
    text = open(args.text, encoding="utf-8").read() if args.text else reference_text()
    token_ids = load_tokenizer(files)(text, add_special_tokens=False)["input_ids"][: args.tokens]
    if len(token_ids) < args.tokens:
        sys.exit(f"the text has {len(token_ids)} tokens, fewer than --tokens {args.tokens}")
    result = measure(args.model, token_ids, device=device, dtype=dtype)
    print(f"command: {' '.join(sys.argv)}")
    print(f"machine: {platform.node()} {platform.machine()}, {device}"
          f"{' ' + torch.cuda.get_device_name(device) if device.type == 'cuda' else ''}; date {date.today()}")
    print(f"model {files.name}, {result.positions} positions, reference {str(dtype).removeprefix('torch.')} "
          f"against FP8 weights (per-row scales, per-token activations)")
    print(f"top-1 agreement {result.top1_agreement:.4f}   mean KL {result.mean_kl:.5f} nats   "
          f"max KL {result.max_kl:.4f} nats")


if __name__ == "__main__":
    main()
