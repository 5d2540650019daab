"""Offline throughput: the same prompts through Spillway's `LLM` and Hugging Face `generate`.

    python tools/bench/engine/offline.py [--model PATH] [--batch 16] [--input-len 128] [--output-len 128]

Both sides get identical token-id prompts, greedy decoding, EOS ignored, the same number of
output tokens, the same dtype and thread count. Prints output tokens/s of each and the ratio.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import time
from datetime import date


def make_prompts(vocab_size: int, batch: int, input_len: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    # Skip the lowest ids, where tokenizers keep their special tokens.
    return [[rng.randrange(256, vocab_size) for _ in range(input_len)] for _ in range(batch)]


def bench_spillway(args, prompts) -> tuple[float, int]:
    from spillway.gateway import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, device=args.device, load_format=args.load_format,
              max_num_seqs=max(args.batch, 1))
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)  # warm-up
    llm.reset_prefix_cache()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    llm.shutdown()
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outputs)


def bench_thinking_budget(args, prompts) -> None:
    """Tokens/s with reasoning on, thinking opened by the prompt, without and with a budget."""
    from spillway.gateway import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, device=args.device, load_format=args.load_format,
              max_num_seqs=max(args.batch, 1), enable_reasoning=True)
    start_ids = llm.get_tokenizer().encode("<think>", add_special_tokens=False)
    opened = [p + start_ids for p in prompts]
    llm.generate(opened[:2], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)  # warm-up
    rates: dict[str, list[float]] = {}
    # Alternate the two settings, so drift on a shared machine hits both alike; report medians.
    for _ in range(args.rounds):
        for label, budget in (("no budget", None), (f"budget {args.thinking_budget}", args.thinking_budget)):
            llm.reset_prefix_cache()
            params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True,
                                    thinking_budget=budget)
            start = time.perf_counter()
            outputs = llm.generate(opened, params, use_tqdm=False)
            elapsed = time.perf_counter() - start
            tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
            reasoning = sum(o.outputs[0].num_reasoning_tokens for o in outputs) / len(outputs)
            rates.setdefault(label, []).append(tokens / elapsed)
            print(f"{label:>11}: {tokens} tokens in {elapsed:7.2f} s = {tokens / elapsed:8.1f} output tokens/s "
                  f"(mean reasoning tokens {reasoning:.1f})")
    llm.shutdown()
    first, second = (statistics.median(values) for values in rates.values())
    print(f"median tokens/s: no budget {first:.1f}, budget {second:.1f}; ratio with / without = {second / first:.3f}x")


def bench_hf(args, prompts) -> tuple[float, int]:
    import torch
    from transformers import AutoModelForCausalLM

    from spillway.worker.models import loader

    files = loader.resolve_model(args.model, args.load_format)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    if files.load_format == "dummy":
        raise SystemExit("the HF baseline needs real weights (a GGUF file or an HF folder)")
    model = AutoModelForCausalLM.from_pretrained(files.path, dtype=dtype).to(args.device).eval()
    input_ids = torch.tensor(prompts, device=args.device)  # equal lengths: no padding needed
    mask = torch.ones_like(input_ids)
    kwargs = dict(do_sample=False, max_new_tokens=args.output_len, min_new_tokens=args.output_len,
                  pad_token_id=0)
    with torch.inference_mode():
        model.generate(input_ids[:2], attention_mask=mask[:2], do_sample=False, max_new_tokens=4,
                       pad_token_id=0)  # warm-up
        start = time.perf_counter()
        out = model.generate(input_ids, attention_mask=mask, **kwargs)
        elapsed = time.perf_counter() - start
    return elapsed, int((out.shape[1] - input_ids.shape[1]) * out.shape[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model path (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--thinking-budget", type=int, default=None,
                        help="instead: compare reasoning runs without and with this thinking budget")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds for --thinking-budget")
    args = parser.parse_args()
    import torch

    from spillway.worker.models import loader

    config = loader.load_config(loader.resolve_model(args.model, args.load_format))
    prompts = make_prompts(config.vocab_size, args.batch, args.input_len, args.seed)
    if args.thinking_budget is not None:
        print(f"workload: batch {args.batch} x ({args.input_len} in + <think>, {args.output_len} out), greedy, "
              f"ignore_eos, {args.dtype}, {date.today()}")
        bench_thinking_budget(args, prompts)
        return
    ours_s, ours_tokens = bench_spillway(args, prompts)
    print(f"machine: {platform.machine()} {os.cpu_count()} cpus, torch {torch.__version__}, "
          f"threads {torch.get_num_threads()}, device {args.device}, {date.today()}")
    print(f"workload: batch {args.batch} x ({args.input_len} in, {args.output_len} out), greedy, ignore_eos, {args.dtype}")
    ours = ours_tokens / ours_s
    print(f"spillway  : {ours_tokens} tokens in {ours_s:7.2f} s = {ours:8.1f} output tokens/s")
    if args.skip_hf:
        return
    hf_s, hf_tokens = bench_hf(args, prompts)
    hf = hf_tokens / hf_s
    print(f"hf generate: {hf_tokens} tokens in {hf_s:7.2f} s = {hf:8.1f} output tokens/s")
    print(f"ratio spillway / hf = {ours / hf:.2f}x")


if __name__ == "__main__":
    main()
