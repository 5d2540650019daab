"""`spillway bench serve|throughput|latency`, as `vllm bench`: the online benchmark of a running
server (gateway/cli/bench_serve.py) and the offline ones over `LLM` (gateway/cli/bench_offline.py).

Only argparse is imported here: the benchmarks' own modules are imported when one runs, so
`spillway serve` starts no slower for having them on its command line.
"""

from __future__ import annotations

import argparse
import sys

from spillway.gateway.cli import bench_offline, bench_serve
from spillway.gateway.cli.serve_args import _show_defaults

KINDS = ("serve", "throughput", "latency")


def add_parser(commands) -> None:
    bench = commands.add_parser("bench", help="benchmark a running server or the offline engine",
                                allow_abbrev=False)
    kinds = bench.add_subparsers(dest="bench_command", required=True, metavar="{serve,throughput,latency}")
    serve = kinds.add_parser("serve", help="load a running server, as `vllm bench serve`", allow_abbrev=False)
    bench_serve.add_args(serve)
    throughput = kinds.add_parser("throughput", help="offline throughput of a batch of requests, as "
                                  "`vllm bench throughput`", allow_abbrev=False)
    bench_offline.add_throughput_args(throughput)
    latency = kinds.add_parser("latency", help="offline latency of one batch, as `vllm bench latency`",
                               allow_abbrev=False)
    bench_offline.add_latency_args(latency)
    for parser in (serve, throughput, latency):
        _show_defaults(parser)


def run(args: argparse.Namespace) -> int:
    name = f"spillway bench {args.bench_command}"
    if args.bench_command == "serve":
        return bench_serve.run(args)
    problems = bench_offline.refusals(args)
    if problems:
        for problem in problems:
            print(f"{name}: {problem}", file=sys.stderr)
        return 2
    try:
        if args.bench_command == "latency":
            return bench_offline.run_latency(args)
        return bench_offline.run_throughput(args)
    except (ValueError, RuntimeError, OSError) as exc:
        print(f"{name}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
