"""The served path against the engine offline, in the same run: `spillway serve` driven by its
own streaming client, then the same workload through `LLM` with the same engine flags.

    python tools/bench/serve/serve.py                         # every row, qwen3-8b shape (GPU)
    python tools/bench/serve/serve.py --quick --rows ttft,itl
    python tools/bench/serve/serve.py --export-tokenizer tok  # here: the tokenizer files, ~3.5 MB
    python tools/bench/serve/serve.py --tokenizer-dir tok     # there: a machine without the default GGUF

The model is a built-in config (`--model`, dummy weights) with the default model's tokenizer
(vocabulary 49152), in a folder built in a temporary directory. Prompts are random token ids
on /v1/completions, greedy, `ignore_eos`, streamed with usage on every chunk; the same prompts
go to the server and to `LLM`.

Rows (`--rows`, all by default; numbers work too):
    1 ttft        idle server, 64-token prompts, 1 token: TTFT against the whole `LLM.generate`
                  of the same request
    2 prefix      a 4,096-token prompt cold, then it again + 32 new tokens (prefix cached), both
                  against offline; and the cold TTFT on a second server with
                  --no-enable-prefix-caching (prefix caching on against off)
    3 itl         one stream: inter-token gaps against offline batch-1 ms/token (the time of
                  `generate` for N tokens less that for 1, over N - 1)
    4 throughput  N x (in, out) sent at once (1000 x (1000/1000); --quick 200): output tok/s
                  against `LLM.generate`; the gateway process's CPU use and tokens per event
    5 small       the same on the smollm2-135m shape, 256 x (128/512) (--quick 64)

Every ratio reads "higher is better, 1.0 is parity": offline time / served time for latencies,
served rate / offline rate for throughput. Rows print as they are measured, again as one table
at the end; --results FILE appends them as JSON lines (tools/bench/engine/engine.py --report prints them).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from datetime import date
from pathlib import Path


from spillway.tools.bench import result_rows  # noqa: E402
from spillway.tools.bench.result_rows import Rows, print_table, row  # noqa: E402
from spillway.tools.loadgen.report import percentile  # noqa: E402
from spillway.tools.bench.serve.server_process import (  # noqa: E402
    ENGINE_FLAGS, Server, default_tokenizer_dir, dummy_model_args, engine_settings, export_tokenizer,
    machine, raise_open_files_limit, serve_flags, temporary_model_folder,
)
from spillway.tools.bench.serve.stream_client import StreamTiming, stream_all, stream_each  # noqa: E402

ROWS = ("ttft", "prefix", "itl", "throughput", "small")
SMALL_MODEL = "smollm2-135m"
SERVED_NAME = "bench"
def spread_ms(seconds: list[float]) -> str:
    return "/".join(f"{percentile(seconds, q) * 1e3:,.2f}" for q in (50, 90, 99))


# ---- the workload: the same prompts for the server and for LLM ----------------------------

class Workload:
    """Random token-id prompts for one model's rows, seeded, distinct (no prefix shared by chance)."""

    def __init__(self, args, rows: list[str], vocab_size: int, seed: int) -> None:
        rng = random.Random(seed)

        def prompts(count: int, length: int) -> list[list[int]]:
            return [[rng.randrange(256, vocab_size) for _ in range(length)] for _ in range(count)]

        self.args = args
        self.rows = rows
        self.warmup = prompts(2, args.long_prompt_len if "prefix" in rows else args.short_prompt_len)
        self.ttft = prompts(args.repeats, args.short_prompt_len)
        self.cold = prompts(args.repeats, args.long_prompt_len)
        self.warm = [p + extra for p, extra in zip(self.cold, prompts(args.repeats, args.warm_new_tokens))]
        self.itl = prompts(args.itl_streams, args.short_prompt_len)
        self.itl_one = prompts(args.itl_streams, args.short_prompt_len)  # offline: the same, 1 token
        self.batches = {}  # row -> (prompts, output length)
        if "throughput" in rows:
            count = args.num_requests or (200 if args.quick else 1000)
            self.batches["throughput"] = (prompts(count, args.input_len), args.output_len)
        if "small" in rows:
            count = args.small_num_requests or (64 if args.quick else 256)
            self.batches["small"] = (prompts(count, args.small_input_len), args.small_output_len)

    def largest_batch(self) -> int:
        return max((len(p) for p, _ in self.batches.values()), default=1)


# ---- the served side ----------------------------------------------------------------------

def measure_served(folder: Path, work: Workload, settings: dict, args) -> dict:
    flags = serve_flags(settings)
    pending = max(4 * settings.get("max_num_seqs", 256), work.largest_batch())  # all at once: no 429
    flags += ["--max-pending-requests", str(pending)]
    results: dict = {}
    with Server(dummy_model_args(folder, flags, SERVED_NAME), args.startup_timeout, args.server_log) as server:
        url = server.url
        asyncio.run(stream_each(url, work.warmup, 4, SERVED_NAME))
        if "ttft" in work.rows:
            results["ttft"] = asyncio.run(stream_each(url, work.ttft, 1, SERVED_NAME))
        if "prefix" in work.rows:
            async def cold_then_warm() -> tuple[list, list]:
                cold, warm = [], []
                for c, w in zip(work.cold, work.warm):
                    cold += await stream_each(url, [c], 1, SERVED_NAME)
                    warm += await stream_each(url, [w], 1, SERVED_NAME)
                return cold, warm
            results["cold"], results["warm"] = asyncio.run(cold_then_warm())
        if "itl" in work.rows:
            results["itl"] = asyncio.run(stream_each(url, work.itl, args.itl_tokens, SERVED_NAME))
        for name, (prompts, out) in work.batches.items():
            print(f"{name}: the served batch starts at {time.strftime('%H:%M:%S')}", flush=True)
            cpu_before, client_before = server.cpu_seconds(), time.process_time()
            timings, wall = asyncio.run(stream_all(url, prompts, out, SERVED_NAME))
            # The client's own CPU too: near one core, it (not the server) may be the limit.
            results[name] = (timings, wall, server.cpu_seconds() - cpu_before, time.process_time() - client_before)
    if "prefix" in work.rows:
        off_flags = flags + ["--no-enable-prefix-caching"]
        with Server(dummy_model_args(folder, off_flags, SERVED_NAME), args.startup_timeout,
                    args.server_log) as server:
            asyncio.run(stream_each(server.url, work.warmup, 4, SERVED_NAME))
            results["cold_off"] = asyncio.run(stream_each(server.url, work.cold, 1, SERVED_NAME))
    return results


# ---- the offline side ---------------------------------------------------------------------

def measure_offline(folder: Path, work: Workload, settings: dict, args) -> dict:
    from spillway.gateway import LLM, SamplingParams

    def greedy(tokens: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)

    def timed(prompts: list[list[int]], tokens: int) -> tuple[float, list]:
        started = time.perf_counter()
        outputs = llm.generate(prompts, greedy(tokens), use_tqdm=False)
        elapsed = time.perf_counter() - started
        assert all(len(o.outputs[0].token_ids) == tokens for o in outputs), "an offline request came back short"
        return elapsed, outputs

    results: dict = {}
    with LLM(str(folder), load_format="dummy", **settings) as llm:
        for prompt in work.warmup:
            timed([prompt], 4)
        if "ttft" in work.rows:
            results["ttft"] = [timed([p], 1)[0] for p in work.ttft]
        if "prefix" in work.rows:
            cold, warm, cached = [], [], []
            for c, w in zip(work.cold, work.warm):
                cold.append(timed([c], 1)[0])
                seconds, outputs = timed([w], 1)
                warm.append(seconds)
                cached.append(outputs[0].num_cached_tokens)
            results["cold"], results["warm"], results["warm_cached"] = cold, warm, cached
        if "itl" in work.rows:
            per_token = [(timed([many], args.itl_tokens)[0] - timed([one], 1)[0]) / (args.itl_tokens - 1)
                         for many, one in zip(work.itl, work.itl_one)]
            results["itl"] = per_token
        for name, (prompts, out) in work.batches.items():
            timed(work.warmup, 8)  # a batch, not the measured prompts (no prefix of theirs cached)
            results[name] = timed(prompts, out)[0]
    return results


# ---- rows ---------------------------------------------------------------------------------

def report(model: str, work: Workload, served: dict, offline: dict, args, rows: Rows) -> None:
    a = args
    if "ttft" in work.rows:
        ttft = [t.ttft for t in served["ttft"]]
        ours, base = percentile(ttft, 50) * 1e3, percentile(offline["ttft"], 50) * 1e3
        rows.add(row(f"{model} TTFT idle, {a.short_prompt_len}-token prompt", ours, "ms p50",
                     "LLM.generate 1 token", base, base / ours,
                     note=f"p50/p90/p99 ms: served {spread_ms(ttft)}, offline {spread_ms(offline['ttft'])}; "
                          f"{a.repeats} requests, distinct prompts"))
    if "prefix" in work.rows:
        cold, warm, off = ([t.ttft for t in served[k]] for k in ("cold", "warm", "cold_off"))
        cold_ms, warm_ms, off_ms = (percentile(x, 50) * 1e3 for x in (cold, warm, off))
        base_cold, base_warm = (percentile(offline[k], 50) * 1e3 for k in ("cold", "warm"))
        hits = sorted({t.cached_tokens for t in served["warm"]})
        misses = sorted({t.cached_tokens for t in served["cold"] + served["cold_off"]})
        rows.add(row(f"{model} TTFT {a.long_prompt_len} cold", cold_ms, "ms p50", "LLM.generate 1 token",
                     base_cold, base_cold / cold_ms,
                     note=f"p50/p90/p99 ms: served {spread_ms(cold)}, offline {spread_ms(offline['cold'])}; "
                          f"cached tokens {misses}"))
        rows.add(row(f"{model} TTFT {a.long_prompt_len} cached + {a.warm_new_tokens}", warm_ms, "ms p50",
                     "LLM.generate 1 token", base_warm, base_warm / warm_ms,
                     note=f"p50/p90/p99 ms: served {spread_ms(warm)}, offline {spread_ms(offline['warm'])}; "
                          f"cached tokens served {hits}, offline {sorted(set(offline['warm_cached']))}; "
                          f"cold / cached TTFT served {cold_ms / warm_ms:.2f}x, offline {base_cold / base_warm:.2f}x"))
        rows.add(row(f"{model} TTFT {a.long_prompt_len} cold, caching on", cold_ms, "ms p50", "caching off",
                     off_ms, off_ms / cold_ms,
                     note=f"p50/p90/p99 ms: caching on {spread_ms(cold)}, off {spread_ms(off)} "
                          f"(second server, --no-enable-prefix-caching)"))
    if "itl" in work.rows:
        timings: list[StreamTiming] = served["itl"]
        gaps = [g for t in timings for g in t.gaps]
        ours, base = percentile(gaps, 50) * 1e3, percentile(offline["itl"], 50) * 1e3
        events = [n for t in timings for n in t.event_tokens]
        rows.add(row(f"{model} ITL one stream, {a.itl_tokens} tokens", ours, "ms p50", "offline ms/token",
                     base, base / ours,
                     note=f"ITL p50/p90/p99 ms {spread_ms(gaps)}; tokens per event {sum(events) / len(events):.2f}; "
                          f"offline (generate {a.itl_tokens} - generate 1) / {a.itl_tokens - 1}, "
                          f"{len(offline['itl'])} streams"))
    for name, (prompts, out) in work.batches.items():
        timings, wall, cpu, client_cpu = served[name]
        generated = sum(t.completion_tokens for t in timings)
        ours, base = generated / wall, len(prompts) * out / offline[name]
        events = [n for t in timings for n in t.event_tokens]
        rows.add(row(f"{model} throughput {len(prompts)} x ({len(prompts[0])}/{out})", ours, "output tok/s",
                     "LLM.generate", base, ours / base,
                     note=f"served {wall:.1f} s, offline {offline[name]:.1f} s; gateway CPU {cpu:.1f} s "
                          f"({cpu / wall:.2f} cores), client CPU {client_cpu / wall:.2f} cores; "
                          f"tokens per event {sum(events) / len(events):.2f}; "
                          f"TTFT p50/p90/p99 ms {spread_ms([t.ttft for t in timings])}; "
                          f"ITL {spread_ms([g for t in timings for g in t.gaps])}"))


# ---- command line -------------------------------------------------------------------------

def parse_rows(text: str) -> list[str]:
    chosen = []
    for part in text.split(","):
        part = part.strip()
        name = ROWS[int(part) - 1] if part.isdigit() and 1 <= int(part) <= len(ROWS) else part
        if name not in ROWS:
            raise argparse.ArgumentTypeError(f"unknown row {part!r}: {', '.join(ROWS)} (or 1-{len(ROWS)})")
        chosen.append(name)
    return [r for r in ROWS if r in chosen]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=parse_rows, default=list(ROWS), help=f"comma-separated: {', '.join(ROWS)}")
    parser.add_argument("--model", default="qwen3-8b", help="built-in config of rows 1-4")
    parser.add_argument("--tokenizer-dir", type=Path, help="the tokenizer files (default: the default model's)")
    parser.add_argument("--export-tokenizer", type=Path, metavar="DIR",
                        help="copy the default model's tokenizer files into DIR and exit")
    parser.add_argument("--quick", action="store_true", help="rows 4 and 5 on 200 and 64 requests")
    parser.add_argument("--repeats", type=int, default=8, help="requests of rows 1 and 2 (distinct prompts)")
    parser.add_argument("--short-prompt-len", type=int, default=64)
    parser.add_argument("--long-prompt-len", type=int, default=4096)
    parser.add_argument("--warm-new-tokens", type=int, default=32)
    parser.add_argument("--itl-tokens", type=int, default=256)
    parser.add_argument("--itl-streams", type=int, default=3)
    parser.add_argument("--num-requests", type=int)
    parser.add_argument("--input-len", type=int, default=1000)
    parser.add_argument("--output-len", type=int, default=1000)
    parser.add_argument("--small-num-requests", type=int)
    parser.add_argument("--small-input-len", type=int, default=128)
    parser.add_argument("--small-output-len", type=int, default=512)
    parser.add_argument("--startup-timeout", type=float, default=900, help="seconds for a server to be healthy")
    parser.add_argument("--seed", type=int, default=0, help="of the prompts")
    parser.add_argument("--results", help="append every row here as a JSON line")
    parser.add_argument("--server-log", type=Path, help="append each server's output (gateway and worker) here")
    engine = parser.add_argument_group("engine flags (to both `spillway serve` and LLM)")
    for name, kind in ENGINE_FLAGS:
        flag = "--" + name.replace("_", "-")
        if kind is bool:
            engine.add_argument(flag, action="store_true")
        elif kind == "optional-bool":
            engine.add_argument(flag, action=argparse.BooleanOptionalAction, default=None)
        else:
            engine.add_argument(flag, type=kind)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.export_tokenizer:
        for path in export_tokenizer(args.export_tokenizer):
            print(f"{path} ({path.stat().st_size:,} bytes)")
        return 0
    if args.itl_tokens < 2:
        raise SystemExit("--itl-tokens must be at least 2")
    raise_open_files_limit()
    tokenizer_dir = args.tokenizer_dir or default_tokenizer_dir()
    settings = engine_settings(args)
    result_rows.MACHINE = machine()
    print(f"{result_rows.MACHINE}, {date.today()}", flush=True)
    rows = Rows(args.results)
    phases = {args.model: [r for r in args.rows if r != "small"]}
    if "small" in args.rows:
        phases.setdefault(SMALL_MODEL, []).append("small")
    for seed, (model, model_rows) in enumerate((m, r) for m, r in phases.items() if r):
        with temporary_model_folder(model, tokenizer_dir) as (folder, vocab):
            work = Workload(args, model_rows, vocab, args.seed + seed)
            served = measure_served(folder, work, settings, args)
            offline = measure_offline(folder, work, settings, args)
            report(model, work, served, offline, args, rows)
    print()
    print_table(rows.rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
