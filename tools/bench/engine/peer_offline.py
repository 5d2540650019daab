"""Offline throughput of one workload through an `LLM` class: Spillway's, or vLLM's where it is installed.

    python tools/bench/engine/peer_offline.py --build qwen3-30b-a3b --tokenizer-dir tok --model /tmp/models
    python tools/bench/engine/peer_offline.py --engine spillway --model /tmp/models/qwen3-30b-a3b
    cd /tmp && PYTHONPATH=/path/to/vllm python PATH/peer_offline.py --engine vllm --model /tmp/models/qwen3-30b-a3b

`--build NAME` writes the folder both engines load and exits: a built-in config (the real
architecture, dummy weights) given the default model's tokenizer and vocabulary
(tools/bench/serve/server_process.py's `build_model_folder`; `tok` from `serve.py
--export-tokenizer`). Run vLLM from outside the checkout: its model inspection runs a child
with the working directory on its path, where kernels/ would pass for another package.

Spillway's offline API is vLLM's, so both engines run the same lines: `LLM(DIR,
load_format=..., dtype="bfloat16", kv_cache_dtype=..., max_num_seqs=..., max_model_len=input +
output, gpu_memory_utilization=...)`, then `generate` over `--num-requests` token-id prompts
(`{"prompt_token_ids": [...]}`, drawn with `--seed` below the folder's vocab_size, above the
first 256 ids where tokenizers keep their special tokens), greedy, EOS ignored, each asking
exactly `--output-len` tokens. A four-prompt warm-up goes first and is not timed. Prints one
JSON line (and appends it to `--results`): output tok/s, total tok/s, elapsed, the engine's
version; Spillway's also its preemptions, KV blocks and steps over the timed run (output tokens
a step: the batch it kept decoding). Run the two engines back to back on the same machine and the same model folder; the
ratio of their lines is the figure.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

ENGINES = ("spillway", "vllm")


def make_prompts(vocab_size: int, count: int, length: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(256, vocab_size) for _ in range(length)]} for _ in range(count)]


def folder_vocab_size(model: str) -> int:
    config = Path(model) / "config.json"
    if not config.is_file():
        raise SystemExit(f"--model {model!r} must be a folder holding config.json (both engines load it)")
    try:
        return int(json.loads(config.read_text())["vocab_size"])
    except (ValueError, KeyError, TypeError) as error:
        raise SystemExit(f"{config} has no integer vocab_size: {error}") from None


def engine_api(name: str):
    """(LLM, SamplingParams, version) of the named engine."""
    if name == "vllm":
        import vllm

        return vllm.LLM, vllm.SamplingParams, f"vllm {vllm.__version__}"
    from importlib.metadata import PackageNotFoundError, version

    from spillway.gateway import LLM, SamplingParams

    try:
        spillway_version = version("spillway")
    except PackageNotFoundError:
        spillway_version = "source tree"
    return LLM, SamplingParams, f"spillway {spillway_version}"


def run(args) -> dict:
    vocab_size = folder_vocab_size(args.model)
    prompts = make_prompts(vocab_size, args.num_requests, args.input_len, args.seed)
    LLM, SamplingParams, engine_version = engine_api(args.engine)
    llm = LLM(args.model, load_format=args.load_format, dtype="bfloat16", kv_cache_dtype=args.kv_cache_dtype,
              max_num_seqs=args.max_num_seqs, max_model_len=args.input_len + args.output_len,
              gpu_memory_utilization=args.gpu_memory_utilization)
    warm = make_prompts(vocab_size, 4, args.input_len, args.seed + 1)
    llm.generate(warm, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    before = llm.stats() if args.engine == "spillway" else None
    started = time.perf_counter()
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True),
                           use_tqdm=False)
    elapsed = time.perf_counter() - started
    generated = sum(len(output.outputs[0].token_ids) for output in outputs)
    if generated != args.num_requests * args.output_len:
        raise SystemExit(f"{engine_version} generated {generated} tokens, not {args.num_requests} x {args.output_len}")
    extra = {}
    if args.engine == "spillway":  # what explains a gap: how often it preempted, how much KV it held, its steps
        after = llm.stats()
        steps = after.num_steps - before.num_steps
        extra = dict(preemptions=after.num_preemptions - before.num_preemptions, kv_blocks=llm.ready.num_gpu_blocks,
                     steps=steps, output_tokens_per_step=round(generated / max(steps, 1), 1))
    return dict(**extra, engine=engine_version, model=args.model, requests=args.num_requests, input_len=args.input_len,
                output_len=args.output_len, kv_cache_dtype=args.kv_cache_dtype, max_num_seqs=args.max_num_seqs,
                elapsed_s=round(elapsed, 3), output_tok_s=round(generated / elapsed, 1),
                total_tok_s=round((generated + args.num_requests * args.input_len) / elapsed, 1))


def build(args) -> None:
    from spillway.tools.bench.serve.server_process import build_model_folder, default_tokenizer_dir

    tokenizer_dir = Path(args.tokenizer_dir) if args.tokenizer_dir else default_tokenizer_dir()
    print(f"built {build_model_folder(args.build, tokenizer_dir, Path(args.model))}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=ENGINES, default="spillway")
    parser.add_argument("--model", required=True, help="a model folder (config.json, tokenizer; weights or dummy)")
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--num-requests", type=int, default=1000)
    parser.add_argument("--input-len", type=int, default=1000)
    parser.add_argument("--output-len", type=int, default=1000)
    parser.add_argument("--max-num-seqs", type=int, default=512)
    parser.add_argument("--kv-cache-dtype", default="fp8")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--results", help="append the JSON line here too")
    parser.add_argument("--build", metavar="CONFIG", help="write --model/CONFIG from a built-in config, then exit")
    parser.add_argument("--tokenizer-dir", help="with --build: the tokenizer's folder (default: the default model's)")
    args = parser.parse_args()
    if args.build:
        build(args)
        return
    if min(args.num_requests, args.input_len, args.output_len, args.max_num_seqs) < 1:
        parser.error("--num-requests, --input-len, --output-len and --max-num-seqs must be positive")
    result = run(args)
    line = json.dumps(result)
    print(line, flush=True)
    if args.results:
        with open(args.results, "a") as out:
            out.write(line + "\n")


if __name__ == "__main__":
    main()
