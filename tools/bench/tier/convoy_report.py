"""tools/bench/tier/served.py's convoy rows: the medians of its rounds (a lone request, then the burst
on the same prefix), every round's pair in the note, and the row of the burst read by several
client processes (`--client-processes`)."""

from __future__ import annotations

import statistics

from spillway.tools.bench.result_rows import Rows, row
from spillway.tools.loadgen.report import percentile


def report_convoy(results: dict, args, rows: Rows, tree: str = "") -> None:
    """The convoy's TTFT p50 and the lone request's TTFT, each the median over the rounds;
    every round's pair, and the last round's counts, in the note."""
    rounds = results["rounds"]
    alone = [r["single"].ttft * 1e3 for r in rounds]
    single, convoy, per_round = against_alone(rounds, alone, "convoy")
    last = rounds[-1]
    spread = "/".join(f"{percentile([t.ttft for t in last['convoy']], q) * 1e3:,.1f}" for q in (50, 90, 99))
    def from_cpu(key: str) -> str:
        return ", ".join(f"{r[key]:,.0f}" for r in rounds)

    rows.add(row(f"{args.model} convoy of {args.convoy} on a CPU-held {args.prefix_len}-token prefix "
                 f"(+{args.suffix_len} each), TTFT p50{tree}",
                 convoy, "ms", "one request alone", single, single / convoy, target=round(1 / 1.2, 3),  # <= 1.2x alone
                 note=f"{len(rounds)} round(s) of alone then convoy, medians; per round alone/convoy p50 ms "
                      f"(ratio): {per_round}; prefix tokens from the CPU tier per round: alone {from_cpu('single_cpu')}, "
                      f"convoy {from_cpu('convoy_cpu')}; last round's convoy TTFT "
                      f"p50/p90/p99 ms {spread}; "
                      f"pushed out by {results['fillers']} prompts of {results['filler_len']} tokens; "
                      f"{args.api_server_count} API server process(es)" + full_tier_note(results, args)
                      + ("; connections opened before the sends, each clock started at its send" if args.preconnect
                         else "")))
    if "spread" in rounds[0]:
        report_spread_client(rounds, alone, args, rows, tree)


def report_spread_client(rounds: list[dict], alone: list[float], args, rows: Rows, tree: str) -> None:
    """The convoy row again with the burst sent and read by `--client-processes` processes (each
    round's second convoy), against the same lone requests."""
    single, convoy, per_round = against_alone(rounds, alone, "spread")
    rows.add(row(f"{args.model} convoy of {args.convoy}, the same, {args.client_processes} client processes{tree}",
                 convoy, "ms", "one request alone", single, single / convoy, target=round(1 / 1.2, 3),
                 note=f"each round's burst again after its own push-out, prompt i sent and read by process "
                      f"i % {args.client_processes} (tools/bench/serve/stream_client.py `stream_all_processes`); per round "
                      f"alone/convoy p50 ms (ratio): {per_round}; prefix tokens from the CPU tier per round: "
                      + ", ".join(f"{r['spread_cpu']:,.0f}" for r in rounds)))


def against_alone(rounds: list[dict], alone: list[float], key: str) -> tuple[float, float, str]:
    """The median lone TTFT, the median over the rounds of the TTFT p50 of each round's burst
    `key` (ms), and every round's pair with its ratio."""
    p50 = [percentile([t.ttft for t in r[key]], 50) * 1e3 for r in rounds]
    per_round = ", ".join(f"{a:.1f}/{c:.1f} ({a / c:.3f})" for a, c in zip(alone, p50))
    return statistics.median(alone), statistics.median(p50), per_round


def full_tier_note(results: dict, args) -> str:
    if not args.full_tier:
        return ""
    single, convoy = (stored / 1e9 for stored in results["rounds"][-1]["stored"])
    return (f"; a full {args.cpu_offload_gb:g} GiB tier (filled by {results['filled']} prompts first), {args.idle_s:g} s "
            f"idle after each push-out; GB stored to the CPU (at eviction or ahead), last round: while the lone request ran "
            f"{single:.2f}, the convoy {convoy:.2f}")
