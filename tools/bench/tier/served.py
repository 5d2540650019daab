"""The CPU KV tier through `spillway serve`: multi-turn chat whose history outgrows the GPU
pool, and a convoy of requests on a prefix held only in the CPU tier, each against a baseline
measured in the same run.

    python tools/bench/tier/served.py --tokenizer-dir tok                  # qwen3-8b shape, dummy weights (GPU)
    python tools/bench/tier/served.py --quick --model smollm2-135m         # small sizes (the CPU too)

The model is a built-in config with dummy weights and the default model's tokenizer (as
tools/bench/serve/serve.py builds it); the GPU pool is fixed with --gpu-blocks so that the workload
outgrows it by a known factor. Prompts are token ids on /v1/completions, greedy, `ignore_eos`.

Rows (`--rows`):
    multiturn  `--conversations` conversations of `--turns` turns, taken round robin (turn 1 of
               each, then turn 2, ...), `--concurrency` requests at once. A turn's prompt is the
               conversation so far: the previous prompt, a reply of `--reply-len` tokens and
               `--user-len` new ones; `--output-len` tokens come back. Served with the tier
               (`--cpu-offload-gb`) and by a second server without it: TTFT p50 of turns 2 on
               (without / with: >= 3 is the target), the P99 inter-token gap each way (the tier
               may add <= 5 ms), and the prompt tokens served from cache. `--repeats N`: N runs of
               each server, alternating, and the medians (the baseline moves by ~20% between runs).
    convoy     a `--prefix-len`-token prefix computed once, then pushed out of the GPU pool by
               filler prompts (so only the CPU tier holds it), then `--convoy` requests at once on
               it (each with `--suffix-len` tokens of its own, default 4: what the row measures is
               one load shared by all without anyone waiting on another, not the compute of long
               suffixes, which grows with their sum): their TTFT p50 against one request alone
               on the same prefix, pushed out the same way first (<= 1.2x is the target).
               `--repeats N`: N rounds of the lone request then the convoy on one server, and
               the medians of each (one lone request's TTFT moved between 40 and 43 ms from run to
               run on the H200: a single one makes a noisy baseline).

`--api-server-count N` serves both rows with N API server processes (`spillway serve
--api-server-count N`): a burst of long prompts reaches the worker sooner.

`--full-tier` runs the convoy row on a full tier, a long-running server's steady state: distinct
prompts first, until `vllm:cpu_cache_usage_perc` reads 1 (a small `--cpu-offload-gb` keeps that
short), and `--idle-s` of quiet after each push-out (the server's idle time between bursts).
The note then gives the bytes stored to the CPU from the lone request's send until its end, and
the convoy's: stores at eviction and write-back ahead alike (the counter does not tell them apart;
the TTFTs tell whether a load waited behind stores).

`--baseline DIR` serves the convoy row with the source tree at DIR too (its server first, the
same prompts): the two trees' figures from one run.

`--preconnect` opens the convoy's connections (the lone request's too) before sending, each
clock started at its send (why: tools/bench/serve/stream_client.py's `stream_all`). `--client-processes K`
sends each round's burst a second time from K client processes, each reading its share of the
answers, for a second row: one process reads 50 first tokens one after another, so its p50
holds its own queue, where the users of a real burst each read their own.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from datetime import date
from pathlib import Path


from spillway.tools.bench import result_rows  # noqa: E402
from spillway.tools.bench.result_rows import Rows, print_table, row  # noqa: E402
from spillway.tools.loadgen.report import percentile  # noqa: E402
from spillway.tools.bench.serve.server_process import (  # noqa: E402
    Server, default_tokenizer_dir, dummy_model_args, machine, raise_open_files_limit, temporary_model_folder,
    tree_env,
)
from spillway.tools.bench.serve.stream_client import StreamTiming, stream_all, stream_all_processes  # noqa: E402
from spillway.tools.bench.tier.convoy_report import report_convoy  # noqa: E402
from spillway.tools.bench.tier.served_traffic import (  # noqa: E402
    SERVED_NAME, cpu_cached_tokens, round_robin, run_bounded, server_gauges,
)

ROWS = ("multiturn", "convoy")


# ---- the workloads: token-id prompts, seeded -----------------------------------------------

def conversation_turns(rng: random.Random, vocab: int, turns: int, user_len: int, reply_len: int,
                       first_len: int | None = None) -> list[list[int]]:
    """The prompts of one conversation's turns: each is the one before, a reply, then a new
    user message. The first is a user message alone, of `first_len` tokens (a document, a long
    system prompt; default `user_len`)."""
    def tokens(count: int) -> list[int]:
        return [rng.randrange(256, vocab) for _ in range(count)]

    prompts = [tokens(user_len if first_len is None else first_len)]
    for _ in range(turns - 1):
        prompts.append(prompts[-1] + tokens(reply_len) + tokens(user_len))
    return prompts


# ---- rows -----------------------------------------------------------------------------------

def measure_multiturn(folder: Path, vocab: int, flags: list[str], args) -> dict:
    rng = random.Random(args.seed)
    conversations = [conversation_turns(rng, vocab, args.turns, args.user_len, args.reply_len, args.first_len)
                     for _ in range(args.conversations)]
    requests = round_robin(conversations)
    results = {"tier": [], "no tier": []}  # a (timings, tokens from the CPU tier) per repeat
    for _ in range(args.repeats):  # the two servers alternate
        for label, extra in (("tier", ["--cpu-offload-gb", str(args.cpu_offload_gb)]), ("no tier", [])):
            with Server(dummy_model_args(folder, flags + extra, SERVED_NAME), args.startup_timeout,
                        args.server_log) as server:
                warm = [[rng.randrange(256, vocab) for _ in range(args.user_len)] for _ in range(2)]
                asyncio.run(run_bounded(server.url, [(0, p) for p in warm], 4, 1))
                before = cpu_cached_tokens(server.url)
                timed = asyncio.run(run_bounded(server.url, requests, args.output_len, args.concurrency))
                results[label].append((timed, cpu_cached_tokens(server.url) - before))
    return results


def report_multiturn(results: dict, args, rows: Rows) -> None:
    """Each figure per repeat, then the median over the repeats (the runs in the note)."""
    def later_turns(timed) -> list[StreamTiming]:
        return [t for turn, t in timed if turn > 0]

    runs = {label: {"ttft": [percentile([t.ttft for t in later_turns(timed)], 50) * 1e3 for timed, _ in repeats],
                    "itl": [percentile([g for _, t in timed for g in t.gaps], 99) * 1e3 for timed, _ in repeats]}
            for label, repeats in results.items()}
    ttft = {label: statistics.median(figures["ttft"]) for label, figures in runs.items()}
    itl = {label: statistics.median(figures["itl"]) for label, figures in runs.items()}
    last = {label: repeats[-1] for label, repeats in results.items()}  # token counts: the last run's
    cached = {label: sum(t.cached_tokens or 0 for t in later_turns(last[label][0])) for label in results}
    prompt = sum(t.prompt_tokens or 0 for t in later_turns(last["tier"][0]))
    spread = "; ".join(f"{label}: {', '.join(f'{v:.1f}' for v in runs[label]['ttft'])}" for label in runs)
    history = args.conversations * history_tokens(args)
    note = (f"{args.conversations} conversations x {args.turns} turns (first {args.first_len}, then +{args.reply_len} "
            f"reply +{args.user_len} user tokens a turn, {args.output_len} out), {args.concurrency} at once; all histories "
            f"{history:,} tokens = {history / (args.gpu_blocks * args.block_size):.1f}x the GPU pool; turns 2+: "
            f"prompt tokens {prompt:,}, from cache with the tier {cached['tier']:,} "
            f"(from the CPU tier {last['tier'][1]:,.0f}), without {cached['no tier']:,}; TTFT p50 per run (ms), "
            f"{spread}")
    rows.add(row(f"{args.model} multi-turn TTFT p50, turns 2+", ttft["tier"], "ms", "without the tier",
                 ttft["no tier"], ttft["no tier"] / ttft["tier"], target=3, note=note))
    rows.add(row(f"{args.model} multi-turn P99 ITL added by the tier", itl["tier"] - itl["no tier"], "ms",
                 "P99 ITL without the tier", itl["no tier"], target=5, lower_is_better=True,
                 note=f"P99 ITL with the tier {itl['tier']:.2f} ms"))


def measure_convoy(folder: Path, vocab: int, flags: list[str], args, env: dict | None = None) -> dict:
    rng = random.Random(args.seed + 1)

    def tokens(count: int) -> list[int]:
        return [rng.randrange(256, vocab) for _ in range(count)]

    prefix = tokens(args.prefix_len)
    pool_tokens = args.gpu_blocks * args.block_size
    filler_len = min(args.prefix_len, pool_tokens // 2)
    fillers = -(-(pool_tokens + args.prefix_len) // filler_len)  # more than the pool holds

    def push_out(url: str) -> None:
        """Compute distinct prompts enough to evict every block the GPU pool holds."""
        asyncio.run(run_bounded(url, [(0, tokens(filler_len)) for _ in range(fillers)], 1, 1))
        time.sleep(args.idle_s)

    def fill_tier(url: str) -> int:
        """Distinct prompts until every CPU slot holds a copy; how many."""
        for count in range(1, 1000):
            asyncio.run(run_bounded(url, [(0, tokens(filler_len))], 1, 1))
            if server_gauges(url)[0] >= 1.0:
                return count
        raise SystemExit("the CPU tier did not fill: is it larger than the prompts can fill?")

    def timed(url: str, count: int, processes: int = 1) -> tuple[list[StreamTiming], float, float]:
        """`count` requests at once on the prefix, after a push-out, sent by `processes` client
        processes: their timings, the prefix tokens served from the CPU tier, the bytes stored
        to the CPU meanwhile."""
        push_out(url)
        before, (_, stored) = cpu_cached_tokens(url), server_gauges(url)
        prompts = [prefix + tokens(args.suffix_len) for _ in range(count)]
        if processes > 1:
            timings = stream_all_processes(url, prompts, 1, SERVED_NAME, processes, preconnect=args.preconnect)
        else:
            timings, _ = asyncio.run(stream_all(url, prompts, 1, SERVED_NAME, preconnect=args.preconnect))
        return timings, cpu_cached_tokens(url) - before, server_gauges(url)[1] - stored

    flags = flags + ["--cpu-offload-gb", str(args.cpu_offload_gb)]
    rounds = []
    with Server(dummy_model_args(folder, flags, SERVED_NAME), args.startup_timeout, args.server_log,
                env=env) as server:
        url = server.url
        filled = fill_tier(url) if args.full_tier else 0
        asyncio.run(run_bounded(url, [(0, prefix + tokens(args.suffix_len))], 1, 1))  # the prefix computed once
        for _ in range(args.repeats):  # alone, then the convoy, each round: the server's drift is shared
            single, single_cpu, single_stored = timed(url, 1)
            convoy, convoy_cpu, convoy_stored = timed(url, args.convoy)
            rounds.append({"single": single[0], "single_cpu": single_cpu, "convoy": convoy,
                           "convoy_cpu": convoy_cpu, "stored": (single_stored, convoy_stored)})
            if args.client_processes > 1:  # the same burst, read by several client processes
                rounds[-1]["spread"], rounds[-1]["spread_cpu"], _ = timed(url, args.convoy, args.client_processes)
    return {"rounds": rounds, "fillers": fillers, "filler_len": filler_len, "filled": filled}


# ---- the command line -----------------------------------------------------------------------

def parse_rows(text: str) -> list[str]:
    chosen = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [name for name in chosen if name not in ROWS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown row {unknown[0]!r}: {', '.join(ROWS)}")
    return [name for name in ROWS if name in chosen]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=parse_rows, default=list(ROWS), help=f"comma-separated: {', '.join(ROWS)}")
    parser.add_argument("--model", default="qwen3-8b", help="built-in config (dummy weights)")
    parser.add_argument("--tokenizer-dir", type=Path, help="the tokenizer files (default: the default model's)")
    parser.add_argument("--quick", action="store_true", help="small sizes: a few seconds of work a row")
    parser.add_argument("--gpu-blocks", type=int, help="the GPU pool in blocks (default 2048; --quick 64)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--cpu-offload-gb", type=float, default=40, help="the CPU tier of the served runs, GiB")
    parser.add_argument("--conversations", type=int)
    parser.add_argument("--turns", type=int)
    parser.add_argument("--first-len", type=int, help="the first turn's prompt (a document, a long system prompt)")
    parser.add_argument("--user-len", type=int)
    parser.add_argument("--reply-len", type=int)
    parser.add_argument("--output-len", type=int)
    parser.add_argument("--concurrency", type=int)
    parser.add_argument("--prefix-len", type=int)
    parser.add_argument("--convoy", type=int)
    parser.add_argument("--suffix-len", type=int, default=4, help="convoy: each request's own tokens after the prefix")
    parser.add_argument("--max-model-len", type=int, help="default: what the GPU pool holds, at most 16,384")
    parser.add_argument("--startup-timeout", type=float, default=900)
    parser.add_argument("--repeats", type=int, default=1, help="multiturn: runs of each server, alternating; "
                        "convoy: rounds of the lone request then the convoy on one server; the figures are medians")
    parser.add_argument("--api-server-count", type=int, default=1, help="API server processes of every server")
    parser.add_argument("--full-tier", action="store_true", help="convoy: fill the CPU tier first (module doc)")
    parser.add_argument("--idle-s", type=float, default=0.0, help="convoy: seconds of quiet after each push-out")
    parser.add_argument("--preconnect", action="store_true", help="convoy: open the connections (the lone request's "
                        "too) before sending, and start each clock at its send (tools/bench/serve/stream_client.py)")
    parser.add_argument("--client-processes", type=int, default=1, help="convoy: each round also sends the burst "
                        "from this many client processes, each reading its share (a second row)")
    parser.add_argument("--baseline", type=Path, help="convoy: also serve the source tree at DIR (mkdir DIR && git "
                        "archive REV | tar -x -C DIR), its server before this tree's, with the same workload")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--server-log", type=Path, help="append each server's output here")
    parser.add_argument("--results", help="append every row here as a JSON line")
    return parser


# A conversation over a document: a 2,048-token first turn, then 256 reply and 256 user tokens a
# turn (the reply is re-sent as prompt tokens never computed before, where a real reply's KV would
# mostly be cached already: a conservative shape).
FULL = dict(gpu_blocks=2048, conversations=22, turns=6, first_len=2048, user_len=256, reply_len=256, output_len=32,
            concurrency=4, prefix_len=10_000, convoy=50)
QUICK = dict(gpu_blocks=32, conversations=4, turns=4, first_len=48, user_len=48, reply_len=48, output_len=4,
             concurrency=2, prefix_len=400, convoy=6)


def history_tokens(args) -> int:
    """One conversation's last prompt."""
    return args.first_len + (args.turns - 1) * (args.reply_len + args.user_len)


def resolve_sizes(args) -> None:
    for name, value in (QUICK if args.quick else FULL).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.max_model_len is None:
        args.max_model_len = min(16384, args.gpu_blocks * args.block_size)
    if args.concurrency > args.conversations:
        raise SystemExit("--concurrency must not exceed --conversations (a conversation's turns go in order)")
    if args.repeats < 1:
        raise SystemExit("--repeats must be at least 1")
    if args.baseline is not None and "multiturn" in args.rows:
        raise SystemExit("--baseline applies to the convoy row only: add --rows convoy")
    if args.client_processes < 1:
        raise SystemExit("--client-processes must be at least 1")
    if args.suffix_len < 1:
        raise SystemExit("--suffix-len must be at least 1 (the requests differ)")
    if args.prefix_len + args.suffix_len > args.gpu_blocks * args.block_size:
        raise SystemExit("--prefix-len + --suffix-len must fit the GPU pool (--gpu-blocks x --block-size)")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    resolve_sizes(args)
    raise_open_files_limit()
    tokenizer_dir = args.tokenizer_dir or default_tokenizer_dir()
    result_rows.MACHINE = machine()
    print(f"{result_rows.MACHINE}, {date.today()}", flush=True)
    flags = ["--num-gpu-blocks-override", str(args.gpu_blocks), "--block-size", str(args.block_size),
             "--max-model-len", str(args.max_model_len), "--max-pending-requests", str(4 * max(args.convoy, 64)),
             "--api-server-count", str(args.api_server_count)]
    rows = Rows(args.results)
    with temporary_model_folder(args.model, tokenizer_dir) as (folder, vocab):
        if "multiturn" in args.rows:
            report_multiturn(measure_multiturn(folder, vocab, flags, args), args, rows)
        if "convoy" in args.rows:
            if args.baseline is not None:  # the same seed: the same prefix and suffixes
                report_convoy(measure_convoy(folder, vocab, flags, args, tree_env(args.baseline)), args, rows,
                              f" (baseline {args.baseline})")
            report_convoy(measure_convoy(folder, vocab, flags, args), args, rows)
    print()
    print_table(rows.rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
