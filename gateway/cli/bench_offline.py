"""`spillway bench latency` and `spillway bench throughput`: `vllm bench latency|throughput`
over the offline `LLM` (gateway/offline/llm.py), with `spillway serve`'s engine flags.

    latency     one batch of `--batch-size` random prompts of `--input-len` tokens, each
                generating exactly `--output-len` tokens, `--num-iters-warmup` times untimed,
                then `--num-iters` times timed: the mean, deviation and percentiles of a batch
    throughput  `--num-prompts` requests handed to the engine at once (random token prompts,
                or a ShareGPT/JSON-lines file with `--dataset-path`): requests and tokens per second

Both print what vLLM prints and write, with `--output-json`, the JSON vLLM writes. Prompts
are token ids drawn with `--seed`, so a tokenizer is needed only for a dataset file. Like
vLLM's latency benchmark, `bench latency` turns prefix caching off unless asked (every
iteration repeats the same prompts).
"""

from __future__ import annotations

import argparse
import inspect
import json
import random
import sys
import time

from spillway.gateway.cli.serve_args import _add_engine_args

LATENCY_PERCENTILES = (10, 25, 50, 75, 90, 99)
PROMPT_ID_LIMIT = 10_000  # random prompt ids below this, as vLLM's latency benchmark draws them


def add_latency_args(parser: argparse.ArgumentParser) -> None:
    bench = parser.add_argument_group("benchmark")
    bench.add_argument("--input-len", type=int, default=32)
    bench.add_argument("--output-len", type=int, default=128)
    bench.add_argument("--batch-size", type=int, default=8)
    bench.add_argument("--n", type=int, default=1, help="sequences generated per prompt")
    bench.add_argument("--num-iters-warmup", type=int, default=10)
    bench.add_argument("--num-iters", type=int, default=30)
    bench.add_argument("--output-json", metavar="FILE", help="write the latencies as JSON")
    _add_refused(bench)
    _add_engine_args(parser)
    parser.set_defaults(enable_prefix_caching=False)


def add_throughput_args(parser: argparse.ArgumentParser) -> None:
    bench = parser.add_argument_group("benchmark")
    bench.add_argument("--backend", default="vllm", choices=["vllm"], help="the offline LLM")
    bench.add_argument("--dataset-name", default="random", choices=["random", "sharegpt", "custom"])
    bench.add_argument("--dataset-path", "--dataset", metavar="FILE", help="ShareGPT JSON or JSON lines of prompts")
    bench.add_argument("--input-len", type=int, help="prompt tokens of random prompts (default 1024)")
    bench.add_argument("--output-len", type=int, help="output tokens (default 128; a dataset's replies set it)")
    bench.add_argument("--prefix-len", type=int, default=0, help="random tokens shared before every prompt")
    bench.add_argument("--random-range-ratio", type=float, default=0.0,
                       help="lengths drawn from [len * (1 - r), len * (1 + r)], r in [0, 1)")
    bench.add_argument("--n", type=int, default=1, help="sequences generated per prompt")
    bench.add_argument("--num-prompts", type=int, default=1000)
    bench.add_argument("--output-json", metavar="FILE", help="write the throughput as JSON")
    _add_refused(bench)
    bench.add_argument("--async-engine", action="store_true", help="refused")
    _add_engine_args(parser)


def _add_refused(group) -> None:
    group.add_argument("--use-beam-search", action="store_true", help="refused")
    group.add_argument("--profile", action="store_true", help="refused")
    group.add_argument("--disable-detokenize", action="store_true", help="refused: outputs are always detokenized")


def refusals(args: argparse.Namespace) -> list[str]:
    problems = [f"--{name.replace('_', '-')} is not available in spillway bench"
                for name in ("use_beam_search", "profile", "disable_detokenize", "async_engine")
                if getattr(args, name, False)]
    for name in ("input_len", "output_len", "batch_size", "n", "num_iters", "num_prompts"):
        value = getattr(args, name, None)
        if value is not None and value < 1:
            problems.append(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    for name in ("num_iters_warmup", "prefix_len"):
        if getattr(args, name, 0) < 0:
            problems.append(f"--{name.replace('_', '-')} must be at least 0, got {getattr(args, name)}")
    if not 0 <= getattr(args, "random_range_ratio", 0.0) < 1:
        problems.append(f"--random-range-ratio must be in [0, 1), got {args.random_range_ratio}")
    if getattr(args, "dataset_name", "random") != "random" and args.dataset_path is None:
        problems.append(f"--dataset-name {args.dataset_name} needs --dataset-path FILE")
    return problems


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The `LLM(...)` arguments of the engine flags: every one `LLM` takes, under its own name."""
    from spillway.gateway.offline.llm import LLM

    probe = argparse.ArgumentParser(add_help=False)
    _add_engine_args(probe)
    taken = set(inspect.signature(LLM.__init__).parameters)
    kwargs = {action.dest: getattr(args, action.dest) for action in probe._actions
              if action.dest in taken and action.dest != "model"}
    if args.model is not None and args.model_tag is not None and args.model != args.model_tag:
        raise ValueError(f"two different models given: {args.model_tag!r} and --model {args.model!r}")
    kwargs["model"] = args.model or args.model_tag
    names = args.served_model_name
    kwargs["served_model_name"] = names[0] if names else None
    return kwargs


def _start_engine(args: argparse.Namespace):
    from spillway.gateway.offline.llm import LLM

    return LLM(**engine_kwargs(args))


def random_prompts(rng: random.Random, count: int, lengths: list[int], vocab_size: int, prefix: list[int]):
    limit = min(vocab_size, PROMPT_ID_LIMIT)
    return [{"prompt_token_ids": prefix + [rng.randrange(limit) for _ in range(length)]} for length in lengths[:count]]


def run_latency(args: argparse.Namespace) -> int:
    from spillway.gateway.api.sampling_params import SamplingParams

    llm = _start_engine(args)
    try:
        if llm.ready.max_model_len < args.input_len + args.output_len:
            print(f"spillway bench latency: --input-len {args.input_len} + --output-len {args.output_len} is more "
                  f"than the model's context of {llm.ready.max_model_len} tokens", file=sys.stderr)
            return 2
        params = SamplingParams(n=args.n, temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=args.output_len)
        prompts = random_prompts(random.Random(args.seed), args.batch_size, [args.input_len] * args.batch_size,
                                 llm.ready.vocab_size, [])

        def one_batch() -> float:
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            return time.perf_counter() - start

        print("Warming up...")
        for _ in range(args.num_iters_warmup):
            one_batch()
        latencies = [one_batch() for _ in range(args.num_iters)]
    finally:
        llm.shutdown()
    results = latency_results(latencies)
    print(format_latency(results))
    if args.output_json:
        _write_json(args.output_json, results)
    return 0


def latency_results(latencies: list[float]) -> dict:
    import numpy as np

    values = np.array(latencies)
    return {"avg_latency": float(values.mean()), "std_latency": float(values.std()), "latencies": latencies,
            "percentiles": {str(q): float(np.percentile(values, q)) for q in LATENCY_PERCENTILES}}


def format_latency(results: dict) -> str:
    lines = [f"Avg latency: {results['avg_latency']} seconds", f"Std latency: {results['std_latency']} seconds"]
    lines += [f"{q}% percentile latency: {value} seconds" for q, value in results["percentiles"].items()]
    return "\n".join(lines)


def _lengths(rng: random.Random, length: int, ratio: float, count: int) -> list[int]:
    low, high = max(1, int(length * (1 - ratio))), max(1, int(length * (1 + ratio)))
    return [rng.randint(low, high) for _ in range(count)]


def _throughput_requests(args: argparse.Namespace, llm) -> tuple[list, list]:
    """(prompts, SamplingParams per prompt)."""
    from spillway.gateway.api.sampling_params import SamplingParams

    rng = random.Random(args.seed)
    count = args.num_prompts
    if args.dataset_path is not None:
        from spillway.tools.loadgen.dataset import load_dataset

        items = load_dataset(args.dataset_path).items
        tokenizer = llm.get_tokenizer()
        if tokenizer is None:
            raise ValueError(f"--dataset-path {args.dataset_path}: the model has no tokenizer for its prompts")
        order = list(range(len(items)))
        rng.shuffle(order)  # a seeded order, as loadgen replays the file
        chosen = [items[order[i % len(order)]] for i in range(count)]
        prompts = [item.prompt for item in chosen]
        outputs = [args.output_len or item.output_len or (len(tokenizer.encode(item.reply)) if item.reply else None)
                   for item in chosen]
        if None in outputs:
            raise ValueError(f"--dataset-path {args.dataset_path}: some prompts give no output length; add --output-len")
    else:
        prefix_limit = min(llm.ready.vocab_size, PROMPT_ID_LIMIT)
        prefix = [rng.randrange(prefix_limit) for _ in range(args.prefix_len)]
        inputs = _lengths(rng, args.input_len or 1024, args.random_range_ratio, count)
        outputs = _lengths(rng, args.output_len or 128, args.random_range_ratio, count)
        prompts = random_prompts(rng, count, inputs, llm.ready.vocab_size, prefix)
    params = [SamplingParams(n=args.n, temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=length)
              for length in outputs]
    return prompts, params


def run_throughput(args: argparse.Namespace) -> int:
    llm = _start_engine(args)
    try:
        prompts, params = _throughput_requests(args, llm)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=True)
        elapsed = time.perf_counter() - start
    finally:
        llm.shutdown()
    prompt_tokens = sum(len(out.prompt_token_ids) for out in outputs)
    output_tokens = sum(len(sample.token_ids) for out in outputs for sample in out.outputs)
    total = prompt_tokens + output_tokens
    print(f"Throughput: {len(outputs) / elapsed:.2f} requests/s, {total / elapsed:.2f} total tokens/s, "
          f"{output_tokens / elapsed:.2f} output tokens/s")
    print(f"Total num prompt tokens:  {prompt_tokens}")
    print(f"Total num output tokens:  {output_tokens}")
    if args.output_json:
        _write_json(args.output_json, {"elapsed_time": elapsed, "num_requests": len(outputs),
                                       "total_num_tokens": total, "requests_per_second": len(outputs) / elapsed,
                                       "tokens_per_second": total / elapsed})
    return 0


def _write_json(path: str, results: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(results, f, indent=4)
        f.write("\n")
