"""A soak run: mixed traffic against `spillway serve` for a while, the resident memory (RSS) of
the gateway and the worker sampled throughout, so that a leak shows as growth.

    python tools/soak/served.py                                        # default model, 30 min, 10 of warm-up
    python tools/soak/served.py --minutes 6 --warmup-min 2 --concurrency 2 --out soak.json --plot soak.png
    python tools/soak/served.py --model PATH -- --max-num-seqs 8       # flags after `--` go to `spillway serve`
    python tools/soak/served.py --url http://127.0.0.1:8000 --pids GATEWAY[,WORKER]   # a server already running

The traffic (tools/soak/traffic.py) keeps `--concurrency` requests in flight: streamed and whole
chat completions and completions, streams dropped mid-way, stop strings, bodies the server must
refuse with 400, /v1/models, /metrics, /tokenize and /detokenize; every answer is checked and
failures are counted by kind. The warm-up is left out of the growth; the verdict is "flat" when
each process grew less than 1% over the last two thirds of the run (at the defaults: the last
20 minutes of 30). The exit status is 0 for a flat run without failures, 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import sys
import time
from pathlib import Path


from spillway.tools.loadgen.corpus import stdlib_words  # noqa: E402
from spillway.tools.bench.serve.server_process import Server, descendants, machine  # noqa: E402
from spillway.tools.bench.serve.stream_client import send_request  # noqa: E402
from spillway.tools.soak.memory import Growth, Sample, draw, growth, rss_bytes, rss_table, verdict, write_samples  # noqa: E402
from spillway.tools.soak.traffic import Tally, drive, traffic  # noqa: E402

PROCESSES = ("gateway", "worker")
PROGRESS_EVERY_S = 60.0


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _pids(text: str) -> list[int]:
    try:
        pids = [int(p) for p in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"GATEWAY[,WORKER] process ids, got {text!r}") from None
    if not 1 <= len(pids) <= 2:
        raise argparse.ArgumentTypeError(f"one or two process ids (gateway, worker), got {len(pids)}")
    return pids


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python tools/soak/served.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=_positive, default=30.0, help="length of the run (default 30)")
    parser.add_argument("--warmup-min", type=float, default=10.0, help="minutes left out of the growth (default 10)")
    parser.add_argument("--concurrency", type=int, default=4, help="requests in flight (default 4)")
    parser.add_argument("--sample-s", type=_positive, default=5.0, help="seconds between RSS samples (default 5)")
    parser.add_argument("--seed", type=int, default=0, help="the traffic mix's seed")
    parser.add_argument("--timeout", type=_positive, default=300.0, help="seconds one request may take (default 300)")
    parser.add_argument("--model", help="what `spillway serve` serves (default: its default model)")
    parser.add_argument("--startup-timeout", type=_positive, default=900.0, help="seconds for the server to start")
    parser.add_argument("--url", help="a server already running (with --pids) instead of starting one")
    parser.add_argument("--pids", type=_pids, help="with --url: the gateway's process id, and the worker's "
                        "(default: the gateway's child running spillway.worker)")
    parser.add_argument("--out", type=Path, help="write the samples there: FILE.csv, or JSON with the summary")
    parser.add_argument("--plot", type=Path, help="draw RSS over time to this PNG (needs matplotlib)")
    return parser


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The tool's arguments and the `spillway serve` flags after `--`; exit 2 naming a bad flag."""
    serve_flags = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    parser = build_parser()
    args = parser.parse_args(own)
    if args.concurrency < 1:
        parser.error(f"--concurrency must be >= 1, got {args.concurrency}")
    if not 0 <= args.warmup_min < args.minutes:
        parser.error(f"--warmup-min must be >= 0 and below --minutes ({args.minutes:g}), got {args.warmup_min:g}")
    if (args.url is None) != (args.pids is None):
        parser.error("--url and --pids go together: the server's address and its processes")
    if args.url is not None and (args.model is not None or serve_flags):
        parser.error("--model and flags after `--` start a server: leave them out with --url")
    if args.plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error("--plot needs matplotlib, which is not installed")
    return args, serve_flags


def worker_of(gateway_pid: int) -> int:
    """The gateway's descendant running `python -m spillway.worker`."""
    for pid in descendants(gateway_pid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"spillway.worker" in argv:
            return pid
    raise ProcessLookupError(f"process {gateway_pid} has no `spillway.worker` child: give --pids GATEWAY,WORKER")


async def served_model(url: str) -> str:
    exchange = await send_request(url, "GET", "/v1/models")
    try:
        return json.loads(await exchange.body())["data"][0]["id"]
    finally:
        exchange.close()


async def soak(url: str, pids: list[int], args: argparse.Namespace, tally: Tally) -> list[Sample]:
    """Traffic for `--minutes` while RSS is sampled every `--sample-s`; the samples."""
    calls = traffic(await served_model(url), stdlib_words(), args.seed)
    start = time.monotonic()
    until = start + args.minutes * 60
    driver = asyncio.ensure_future(drive(url, calls, args.concurrency, until, tally, args.timeout))
    samples: list[Sample] = []
    try:
        next_progress = start
        while True:
            now = time.monotonic()
            samples.append(Sample(now - start, tally.total, tuple(rss_bytes(pid) for pid in pids)))
            if now >= next_progress:
                next_progress += PROGRESS_EVERY_S
                _progress(samples[-1], sum(tally.errors.values()))
            if now >= until or driver.done():
                break
            await asyncio.sleep(min(args.sample_s, until - now))
    except BaseException:
        driver.cancel()
        raise
    await driver  # the calls in flight at the end finish (each within --timeout)
    return samples


def _progress(sample: Sample, errors: int) -> None:
    sizes = ", ".join(f"{name} {rss / 1e6:,.1f} MB" for name, rss in zip(PROCESSES, sample.rss_bytes))
    print(f"soak: {sample.elapsed_s / 60:5.1f} min: {sizes}; {sample.requests_done:,} requests, {errors} failed",
          file=sys.stderr, flush=True)


def report(args: argparse.Namespace, names: tuple[str, ...], samples: list[Sample], tally: Tally,
           described: str) -> tuple[str, dict, bool]:
    """The printed report, its summary for --out, and whether the run passed."""
    warmup_s, total_s = args.warmup_min * 60, args.minutes * 60
    verdict_s = max(warmup_s, total_s / 3)
    measured = [growth(samples, i, warmup_s) for i in range(len(names))]
    judged = [growth(samples, i, verdict_s) for i in range(len(names))]
    window = f"{verdict_s / 60:.3g} to {args.minutes:g} min"
    line = verdict(names, judged, window)
    lines = [described, "", rss_table(names, samples, warmup_s), "",
             f"Requests: {tally.total:,} done ({', '.join(f'{k} {n:,}' for k, n in sorted(tally.done.items()))})",
             f"Failures: {sum(tally.errors.values()):,}" + "".join(
                 f"\n  {key}: {count:,} (first: {tally.examples[key]})" for key, count in sorted(tally.errors.items())),
             f"Growth after the warm-up ({args.warmup_min:g} to {args.minutes:g} min):"]
    lines += [f"  {name:<8} {_described(g)}" for name, g in zip(names, measured)]
    if verdict_s > warmup_s:
        lines.append(f"Growth over the verdict window ({window}):")
        lines += [f"  {name:<8} {_described(g)}" for name, g in zip(names, judged)]
    lines.append(f"Verdict: {line}")
    summary = {"described": described, "minutes": args.minutes, "warmup_min": args.warmup_min,
               "concurrency": args.concurrency, "requests": tally.total, "done": dict(tally.done),
               "failures": dict(tally.errors), "growth_mb": {n: g and g.mb for n, g in zip(names, measured)},
               "growth_percent": {n: g and g.percent for n, g in zip(names, measured)}, "verdict": line}
    return "\n".join(lines), summary, line.startswith("flat") and not tally.errors


def _described(g: Growth | None) -> str:
    return g.describe() if g is not None else "too few samples"


def main(argv: list[str] | None = None) -> int:
    args, serve_flags = parse_args(sys.argv[1:] if argv is None else argv)
    server = None
    if args.url is None:
        serve_args = ([args.model] if args.model else []) + serve_flags
        source = f"spillway serve {shlex.join(serve_args) or '(the default model)'}"
        print(f"soak: starting {source}", file=sys.stderr, flush=True)
        server = Server(serve_args, args.startup_timeout)
        url, pids = server.url, [server.process.pid]
    else:
        url, pids, source = args.url.rstrip("/"), list(args.pids), args.url
    tally = Tally()
    try:
        if len(pids) == 1:
            pids.append(worker_of(pids[0]))
        samples = asyncio.run(soak(url, pids, args, tally))
    except ProcessLookupError as exc:
        print(f"soak: {exc}", file=sys.stderr)
        return 1
    finally:
        if server is not None:
            server.stop()
    described = (f"Soak of {source} (gateway pid {pids[0]}, worker pid {pids[1]}): {args.minutes:g} min, "
                 f"{args.warmup_min:g} of warm-up, {args.concurrency} in flight, seed {args.seed}, RSS every "
                 f"{args.sample_s:g} s; {time.strftime('%Y-%m-%d %H:%M %z')}; {machine()}")
    text, summary, passed = report(args, PROCESSES, samples, tally, described)
    print(text)
    if args.out is not None:
        write_samples(args.out, PROCESSES, samples, summary)
    if args.plot is not None:
        draw(args.plot, PROCESSES, samples, args.warmup_min * 60)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
