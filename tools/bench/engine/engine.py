"""GPU benchmarks of the engine, each figure beside a baseline measured in the same run.

    python tools/bench/engine/engine.py --decode qwen3-8b,smollm2-135m [--hf]   # batch-1 decode
    python tools/bench/engine/engine.py --decode qwen3-8b --quantization fp8   # FP8 and bf16, each vs its floor
    python tools/bench/engine/engine.py --prefill --attention                  # one 4096 prompt; the kernel
    python tools/bench/engine/engine.py --throughput [--quick] [--hf]          # 1000 x (1000 in, 1000 out)
    python tools/bench/engine/engine.py --report results.jsonl                 # the table of earlier runs

    decode      ms/token of Engine.step() for one request (dummy weights of a built-in config),
                against the floor (weights read once per token at the read bandwidth measured
                here) and against HF `generate` with a static cache and torch.compile
                (reduce-overhead) on the same weights; also the decode graph's GPU time alone;
                --quantization fp8 measures the FP8 model after the bf16 one (its floor: its own
                bytes, half the projections'), and their ratio; --device cpu runs it on the CPU
    prefill     one 4096-token prompt through the runner (Qwen3-8B shape), FLOP/s against the
                bf16 matrix-product rate measured here (FLOPs = 2 * params * tokens + attention)
    attention   paged_decode_attention alone, batch 64 x 4096 context, bytes/s against the
                read bandwidth measured here, over a bf16 cache and an fp8 one
    throughput  offline `LLM.generate`, random prompts, greedy, EOS ignored, output tokens/s;
                --hf adds HF `generate_batch` on a smaller slice (it is far slower);
                --kv-cache-dtype fp8 --max-num-seqs 512 is the fastest setting measured

Every row is printed as it is measured and again in the table at the end; --results FILE
also appends each row (with command, machine and date) as a JSON line. Record figures in
docs/performance.md.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import time
from datetime import date


from spillway.protocol.config import KV_CACHE_DTYPES, QUANTIZATION_METHODS  # noqa: E402
from spillway.tools.bench import result_rows  # noqa: E402
from spillway.tools.bench.ceilings import bench_ms, copy_bandwidth, machine, matmul_rate, read_bandwidth  # noqa: E402
from spillway.tools.bench.engine.hf_baselines import hf_generate_batch, hf_static_compile_ms_per_token  # noqa: E402
from spillway.tools.bench.engine.step_profile import kernel_profile, run_step_profile  # noqa: E402
from spillway.tools.bench.result_rows import Rows, print_table, row  # noqa: E402
from spillway.tools.bench.engine.engine_runs import decode_ms_per_token, make_engine, weight_bytes_per_token  # noqa: E402

DEFAULT_DECODE_MODELS = "qwen3-8b,smollm2-135m"
TARGETS = {
    "decode qwen3-8b vs floor": 0.80,
    "decode qwen3-8b vs hf": 1.5,
    "decode smollm2-135m ms/token": 1.5,
    "prefill 4096 vs matmul": 0.55,
    "decode attention vs bandwidth": 0.75,
    "throughput tok/s": 10_000,
}


# ---- children ------------------------------------------------------------------------------

def run_child(args) -> None:
    """`--child KIND`: one HF baseline in its own process, its result as the last stdout line."""
    if args.child == "hf-decode":
        result = hf_static_compile_ms_per_token(args.child_model, args.new_tokens)
    else:
        rng = random.Random(2)
        prompts = [[rng.randrange(256, 151936) for _ in range(args.input_len)] for _ in range(args.hf_requests)]
        tok_s, note = hf_generate_batch(prompts, args.hf_output_len)
        result = {"tok_s": tok_s, "note": note}
    print(json.dumps(result))


def in_child(extra: list[str], timeout_s: float) -> tuple[dict | None, str]:
    """Run this script with `extra` in a child process (an HF crash cannot take our figures
    with it); `(last line as JSON, "")` or `(None, why it failed)`."""
    import subprocess

    command = [sys.executable, os.path.abspath(__file__), *extra]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return None, f"did not finish within {timeout_s:.0f} s"
    lines = done.stdout.strip().splitlines()
    if done.returncode == 0 and lines:
        return json.loads(lines[-1]), ""
    return None, f"exit {done.returncode}: {done.stderr.strip()[-400:]}"


# ---- sub-benchmarks -------------------------------------------------------------------------

def run_decode(args, rows: Rows) -> None:
    """Ours for every model first, then the HF baselines, so a slow compile loses none of ours."""
    bandwidth = read_bandwidth(args.device)
    rows.add(row("read bandwidth (sum over 4 GiB)", bandwidth / 1e9, "GB/s"))
    if args.device != "cpu":
        rows.add(row("copy bandwidth (2 GiB, read + write)", copy_bandwidth() / 1e9, "GB/s"))
    engines, our_ms = {}, {}
    for name in args.decode.split(","):
        for quantization in dict.fromkeys([None, args.quantization]):
            label = name if quantization is None else f"{name} {quantization}"
            engine = make_engine(name, max_model_len=4608, num_blocks=320, quantization=quantization,
                                 device=args.device)
            ms = decode_row(args, rows, engine, label, bandwidth)
            if quantization is None:
                engines[name], our_ms[name] = engine, ms
            else:
                rows.add(row(f"decode {label} batch 1 vs unquantized", ms, "ms/token", "unquantized",
                             our_ms[name], our_ms[name] / ms))
                del engine
    if args.hf:
        run_hf_decode(args, rows, engines, our_ms)
    if args.profile:  # last: the profiler's hooks would slow what runs after it
        for name, engine in engines.items():
            print(f"kernels of one eager decode step of {name} (batch 1, context 300):")
            print(kernel_profile(engine.runner, steps=5))


def decode_row(args, rows: Rows, engine, label: str, bandwidth: float) -> float:
    """Batch-1 decode ms/token of `engine` against its floor (its weights read once a token)."""
    weights = weight_bytes_per_token(engine.runner.model)
    floor_ms = weights / bandwidth * 1e3
    decode_ms_per_token(engine, 16, 32, f"warm-{label}")
    ms = decode_ms_per_token(engine, args.prompt_len, args.new_tokens, f"bench-{label}")
    decode_graphs = engine.runner.cuda_graphs.decode
    graph_ms = bench_ms(lambda: decode_graphs.replay(1)) if decode_graphs else float("nan")
    rows.add(row(f"decode {label} batch 1", ms, "ms/token", "floor", floor_ms, floor_ms / ms,
                 target=TARGETS.get(f"decode {label} vs floor"),
                 note=f"prompt {args.prompt_len}, {args.new_tokens} steps; decode graph replay alone "
                      f"{graph_ms:.3f} ms; weights read per token {weights / 1e9:.3f} GB"))
    if f"decode {label} ms/token" in TARGETS:
        rows.add(row(f"decode {label} batch 1 (absolute)", ms, "ms/token",
                     target=TARGETS[f"decode {label} ms/token"], lower_is_better=True))
    return ms


def run_hf_decode(args, rows: Rows, engines: dict, our_ms: dict[str, float]) -> None:
    """Each HF baseline in a child process, the smallest model first."""
    import torch

    smallest_first = sorted(engines, key=lambda name: weight_bytes_per_token(engines[name].runner.model))
    for name in smallest_first:
        ms = our_ms[name]
        result, why = in_child(["--child", "hf-decode", "--child-model", name, "--new-tokens", str(args.new_tokens)],
                               args.hf_timeout)
        if result is None:  # the baseline failing must not hide our figures
            rows.add(row(f"decode {name} batch 1 vs HF", ms, "ms/token", note=f"HF failed: {why}"))
            continue
        hf_ms = result["ms_per_token"]
        rows.add(row(f"decode {name} batch 1 vs HF", ms, "ms/token", "HF static+compile", hf_ms, hf_ms / ms,
                     target=TARGETS.get(f"decode {name} vs hf"),
                     note=f"HF: 1-token prompt, whole generate over {args.new_tokens} new tokens"))
        torch.cuda.empty_cache()


def run_prefill(args, rows: Rows) -> None:
    from spillway.worker.runner.model_runner import ChunkInput

    rate = matmul_rate()
    rows.add(row("bf16 matmul 8192^3", rate / 1e12, "TFLOP/s"))
    engine = make_engine("qwen3-8b", max_model_len=4608, num_blocks=320, enforce_eager=True)
    runner, spec = engine.runner, engine.runner.model.spec
    tokens = args.prefill_len
    rng = random.Random(1)
    chunk = ChunkInput([rng.randrange(256, spec.vocab_size) for _ in range(tokens)], 0,
                       list(range(-(-tokens // engine.block_size))))
    ms = bench_ms(lambda: runner.execute([chunk]), warmup=200, rep=1000)
    params = sum(p.numel() for p in runner.model.parameters())
    matmul_params = params - spec.vocab_size * spec.hidden_size * (1 if spec.tie_word_embeddings else 2)
    flops = (2 * matmul_params * tokens + 2 * spec.vocab_size * spec.hidden_size
             + 2 * spec.num_layers * spec.num_heads * spec.head_dim * tokens * tokens)
    achieved = flops / (ms / 1e3)
    rows.add(row(f"prefill qwen3-8b {tokens} tokens", achieved / 1e12, "TFLOP/s", "bf16 matmul",
                    rate / 1e12, achieved / rate, target=TARGETS["prefill 4096 vs matmul"],
                    note=f"{ms:.1f} ms, {flops / 1e12:.1f} TFLOP"))


def run_attention(args, rows: Rows) -> None:
    """The decode kernel alone over a bf16 cache (the figure with a target) and an fp8 one."""
    import torch

    from spillway.kernels.paged_attention_decode import paged_decode_attention

    bandwidth = read_bandwidth()
    batch, context, heads, kv_heads, head_dim, block_size = 64, 4096, 32, 8, 128, 16
    blocks_per_seq = context // block_size
    num_blocks = batch * blocks_per_seq
    tables = torch.randperm(num_blocks, device="cuda").to(torch.int32).view(batch, blocks_per_seq)
    context_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, heads, head_dim, dtype=torch.bfloat16, device="cuda")
    scale = head_dim**-0.5
    bf16_ms = None
    for name, cache_dtype in (("bf16", torch.bfloat16), ("fp8", torch.float8_e4m3fn)):
        kv_cache = torch.randn(num_blocks, 1, 2, block_size, kv_heads, head_dim, dtype=torch.bfloat16,
                               device="cuda").to(cache_dtype)
        ms = bench_ms(lambda: paged_decode_attention(q, kv_cache, 0, tables, context_lens, scale))
        kv_bytes = kv_cache.numel() * kv_cache.element_size()
        achieved = kv_bytes / (ms / 1e3)
        speedup = f"; {bf16_ms / ms:.2f}x the bf16 cache's time" if bf16_ms else ""
        rows.add(row(f"decode attention batch 64 x 4096, {name} cache", achieved / 1e9, "GB/s", "read bandwidth",
                     bandwidth / 1e9, achieved / bandwidth,
                     target=TARGETS["decode attention vs bandwidth"] if name == "bf16" else None,
                     note=f"{ms * 1e3:.1f} us per layer; 32 q / 8 kv heads, head_dim 128, block 16{speedup}"))
        bf16_ms = bf16_ms or ms
        del kv_cache


def run_throughput(args, rows: Rows) -> None:
    num_requests = args.num_requests or (200 if args.quick else 1000)
    rng = random.Random(2)
    vocab = 151936
    prompts = [[rng.randrange(256, vocab) for _ in range(args.input_len)] for _ in range(num_requests)]
    if not args.hf_only:
        name = args.throughput_model
        rate = matmul_rate() if name != "qwen3-8b" else None
        ours, note, model_flops = spillway_generate(args, prompts)
        rows.add(row(f"throughput {name}", ours, "output tok/s", note=note,
                     target=TARGETS["throughput tok/s"] if name == "qwen3-8b" else None, target_is_value=True))
        if rate is not None:  # a model with no other baseline: its matrix products against the GPU's rate
            rows.add(row(f"throughput {name}, model FLOP/s", model_flops / 1e12, "TFLOP/s", "bf16 matmul 8192^3",
                         rate / 1e12, model_flops / rate,
                         note="2 x (layer params x all tokens + head params x output tokens) / elapsed; attention left out"))
        if args.profile:
            run_step_profile(args, prompts)
    if args.hf or args.hf_only:
        extra = ["--child", "hf-batch", "--hf-requests", str(args.hf_requests), "--input-len", str(args.input_len),
                 "--hf-output-len", str(args.hf_output_len)]
        result, why = in_child(extra, args.hf_timeout)
        if result is None:
            rows.add(row("throughput qwen3-8b, HF generate_batch", None, "output tok/s", note=f"HF failed: {why}"))
            return
        ratio = ours / result["tok_s"] if not args.hf_only and result["tok_s"] else None
        rows.add(row("throughput qwen3-8b, HF generate_batch", result["tok_s"], "output tok/s",
                     note=f"{result['note']}; Spillway / HF = {ratio:.1f}x" if ratio else result["note"]))


def spillway_generate(args, prompts: list[list[int]]) -> tuple[float, str, float]:
    """Output tokens/s of `LLM.generate` over `prompts`, greedy, EOS ignored; the note; the
    model's matrix-product FLOP/s over the same time."""
    from spillway.gateway import LLM, SamplingParams

    llm = LLM(args.throughput_model, load_format="dummy", dtype="bfloat16", kv_cache_dtype=args.kv_cache_dtype,
              async_scheduling=args.async_scheduling, max_num_seqs=args.max_num_seqs, max_model_len=args.input_len + args.output_len + 16,
              gpu_memory_utilization=0.9)
    llm.generate(prompts[:4], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    started = time.perf_counter()
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True),
                           use_tqdm=False)
    elapsed = time.perf_counter() - started
    stats = llm.stats()
    num_blocks = llm.ready.num_gpu_blocks
    llm.shutdown()
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    layers, head = matmul_params(args.throughput_model)
    flops = 2 * (layers * (sum(map(len, prompts)) + generated) + head * generated)
    note = (f"{len(prompts)} x ({args.input_len} in, {args.output_len} out), {elapsed:.1f} s, max_num_seqs "
            f"{args.max_num_seqs}, {num_blocks} KV blocks ({args.kv_cache_dtype} KV cache), "
            f"{stats.num_preemptions} preemptions, async scheduling {'off' if args.async_scheduling is False else 'on'}")
    return generated / elapsed, note, flops / elapsed


def matmul_params(name: str) -> tuple[int, int]:
    """Parameters of a built-in config's matrix products: those of its layers (every token
    runs them; of a mixture of experts, the experts it is routed to) and of its head (only the
    tokens whose logits are taken)."""
    from spillway.protocol.local.model_files import load_config, resolve_model

    config = load_config(resolve_model(name, "dummy"))
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    attention = config.hidden_size * head_dim * (2 * config.num_attention_heads + 2 * config.num_key_value_heads)
    experts = getattr(config, "num_experts", None)
    if experts:  # a mixture of experts: each token runs its top-k experts and the router
        mlp = 3 * config.hidden_size * config.moe_intermediate_size * config.num_experts_per_tok \
            + config.hidden_size * experts
    else:
        mlp = 3 * config.hidden_size * config.intermediate_size
    return config.num_hidden_layers * (attention + mlp), config.vocab_size * config.hidden_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--decode", nargs="?", const=DEFAULT_DECODE_MODELS, help="built-in configs, comma-separated")
    parser.add_argument("--prefill", action="store_true")
    parser.add_argument("--attention", action="store_true")
    parser.add_argument("--throughput", action="store_true")
    parser.add_argument("--hf", action="store_true", help="measure the Hugging Face baselines too")
    parser.add_argument("--hf-only", action="store_true", help="throughput: the HF baseline alone")
    parser.add_argument("--profile", action="store_true",
                        help="decode: device time by kernel; throughput: the mixed steps that prefill a full "
                             "batch (their rate, the kernels of one) and a full-batch decode step taken apart")
    parser.add_argument("--quick", action="store_true", help="throughput on 200 requests instead of 1000")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--prefill-len", type=int, default=4096)
    parser.add_argument("--num-requests", type=int)
    parser.add_argument("--input-len", type=int, default=1000)
    parser.add_argument("--output-len", type=int, default=1000)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--throughput-model", default="qwen3-8b",
                        help="throughput: the built-in config (other than qwen3-8b: with its model FLOP/s "
                             "against the bf16 matmul rate measured in the same run)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                        help="throughput and its --profile: the KV cache's dtype")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                        help="throughput: overlap the next step's scheduling with this one (default on)")
    parser.add_argument("--quantization", choices=QUANTIZATION_METHODS,
                        help="decode: also the model with its projections in FP8, against its own floor and "
                             "the unquantized one")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                        help="decode only: where the engine runs (default %(default)s)")
    parser.add_argument("--hf-requests", type=int, default=64)
    parser.add_argument("--hf-output-len", type=int, default=128)
    parser.add_argument("--hf-timeout", type=float, default=300, help="seconds for each HF baseline")
    parser.add_argument("--results", help="append every row here as a JSON line")
    parser.add_argument("--child", choices=["hf-decode", "hf-batch"], help=argparse.SUPPRESS)
    parser.add_argument("--child-model", help=argparse.SUPPRESS)
    parser.add_argument("--report", metavar="FILE", help="print the table of FILE's rows and exit")
    args = parser.parse_args()
    if args.report:
        with open(args.report) as f:
            print_table([json.loads(line) for line in f if line.strip()])
        return
    import torch

    if args.device == "cpu" and (args.prefill or args.attention or args.throughput or args.hf or args.hf_only):
        raise SystemExit("tools/bench/engine/engine.py --device cpu runs --decode only")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("tools/bench/engine/engine.py needs a CUDA GPU")
    if args.child:
        run_child(args)
        return
    result_rows.MACHINE = machine()
    print(f"{result_rows.MACHINE}, {date.today()}")
    rows = Rows(args.results)
    for enabled, bench in ((args.decode, run_decode), (args.prefill, run_prefill),
                           (args.attention, run_attention), (args.throughput or args.hf_only, run_throughput)):
        if enabled:
            bench(args, rows)
            # The next one sizes its KV cache from free memory: give back what this one held.
            gc.collect()
            torch.cuda.empty_cache()
    print()
    print_table(rows.rows)


if __name__ == "__main__":
    main()
