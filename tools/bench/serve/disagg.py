"""Disaggregated prefill and decode through `spillway serve --prefill-workers 1 --decode-workers 1`,
measured by tools/loadgen, each figure beside its baseline from the same run.

    python tools/bench/serve/disagg.py                  # the default model, sizes for a 2-core CPU
    python tools/bench/serve/disagg.py --model qwen3-8b --transfer-len 4096 --decoders 32 \\
        --decode-len 512 --long-len 8192 --long-rate 1 --duration 60 \\
        --device-args "--kv-cache-dtype fp8"        # one GPU, the two workers sharing it

`--model` is a model folder, a .gguf file, or a built-in config (qwen3-8b, ...: dummy weights and
the default model's tokenizer, as tools/bench/serve/serve.py builds it; `--tokenizer-dir` where the
default model is not installed); left out, the default model. `--device-args` go to every
`spillway serve` after the tool's own flags, which they may override.

Rows (`--rows`, both by default):
    transfer  one disaggregated server; `--transfer-rounds` prompts of `--transfer-len` tokens, each
              new, one at a time, asking one token: the KV bytes the decode worker pulled and the
              seconds the pulls took, from the server's /metrics (vllm:kv_transfer_* counters),
              as GB/s. The ceiling beside it: the same bytes copied device -> pinned host -> device
              by this process (on the CPU, host -> host twice), timed here in the same run.
    mixed     a plain server (one worker) and a disaggregated one, each under the same two loads
              at once: `--decoders` streams of `--decoder-input-len` prompt tokens decoding
              `--decode-len` tokens (closed loop), and long prompts of `--long-len` tokens asking
              `--long-output-len` at `--long-rate` per second, for `--duration` seconds. A line:
              the decoders' ITL p50/p99 and output tok/s, the long prompts' TTFT p50. Summary:
              the decoders' ITL p99 without disaggregation over with it (above 1: long prefills
              stall decodes less when disaggregated).

Every line is printed as a JSON line and appended to `--results`; `--output-dir` keeps each
run's loadgen JSON and printed summary and each server's log.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import shlex
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import date
from pathlib import Path

import httpx

from spillway.tools.bench.serve.replicas import exit_on_sigterm, model_args, model_folder, run_loadgen
from spillway.tools.bench.serve.server_process import Server, machine

ROWS = ("transfer", "mixed")
PERCENTILES = ["--percentiles", "50,99"]
DISAGGREGATED = ["--prefill-workers", "1", "--decode-workers", "1"]


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def kv_transfer_counters(url: str) -> dict[str, float]:
    """The server's vllm:kv_transfer_* samples summed over engines, by name and direction."""
    text = httpx.get(url + "/metrics", timeout=10, trust_env=False).raise_for_status().text
    totals: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("vllm:kv_transfer_") or line.startswith("#"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name = name_labels.split("{", 1)[0]
        direction = next((part.split("=", 1)[1].strip('"') for part in name_labels.split("{", 1)[-1].rstrip("}")
                          .split(",") if part.startswith("direction=")), "")
        key = f"{name}:{direction}" if direction else name
        totals[key] = totals.get(key, 0.0) + float(value)
    return totals


def copy_ceiling(nbytes: int, repeats: int = 3) -> float:
    """Bytes a second of `nbytes` copied device -> pinned host -> device (CUDA) or host -> host twice
    (CPU): the copies a transfer through host memory cannot do without. The median of `repeats`."""
    import torch

    cuda = torch.cuda.is_available()
    source = torch.empty(nbytes, dtype=torch.uint8, device="cuda" if cuda else "cpu")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    target = torch.empty_like(source)
    times = []
    for attempt in range(repeats + 1):
        if cuda:
            torch.cuda.synchronize()
        started = time.perf_counter()
        host.copy_(source)
        target.copy_(host)
        if cuda:
            torch.cuda.synchronize()
        if attempt:  # the first is a warm-up
            times.append(time.perf_counter() - started)
    return nbytes / sorted(times)[len(times) // 2]


class Bench:
    def __init__(self, args, model: list[str], out_dir: Path) -> None:
        self.args, self.model, self.out_dir = args, model, out_dir
        self.stamp = dict(model=args.model or "default", machine=machine(), date=str(date.today()),
                          command=shlex.join([sys.argv[0].rpartition("/")[2], *sys.argv[1:]]))

    def emit(self, line: dict) -> dict:
        text = json.dumps({**line, **self.stamp})
        print(text, flush=True)
        if self.args.results:
            with open(self.args.results, "a") as out:
                out.write(text + "\n")
        return line

    def served(self, name: str, flags: list[str]) -> Server:
        flags = [*self.model, *flags, *shlex.split(self.args.device_args)]
        log(f"{name}: spillway serve {shlex.join(flags)}")
        return Server(flags, self.args.startup_timeout, keep_log=self.out_dir / f"server-{name}.log",
                      die_with_parent=True)

    def transfer(self) -> None:
        args = self.args
        load = ["--workload", "random", "--input-len", str(args.transfer_len), "--output-len", "1", *PERCENTILES,
                "--num-requests", str(args.transfer_rounds), "--concurrency", "1"]
        with self.served("transfer", DISAGGREGATED) as server:
            before = kv_transfer_counters(server.url)
            document = run_loadgen(server.url, load, args, self.out_dir / "loadgen-transfer.json")
            after = kv_transfer_counters(server.url)
        moved = after.get("vllm:kv_transfer_bytes_total:received", 0) - before.get("vllm:kv_transfer_bytes_total:received", 0)
        seconds = (after.get("vllm:kv_transfer_seconds_total:received", 0)
                   - before.get("vllm:kv_transfer_seconds_total:received", 0))
        per_prompt = moved / max(1, args.transfer_rounds)
        ceiling = copy_ceiling(int(per_prompt)) if per_prompt else None
        rate = moved / seconds if seconds else None
        self.emit(dict(row="transfer", prompt_tokens=args.transfer_len, prompts=args.transfer_rounds,
                       failed=document["summary"]["num_failed"], bytes_per_prompt=int(per_prompt),
                       seconds_per_prompt=round(seconds / max(1, args.transfer_rounds), 5),
                       gb_s=round(rate / 1e9, 3) if rate else None,
                       ceiling_gb_s=round(ceiling / 1e9, 3) if ceiling else None,
                       of_ceiling=round(rate / ceiling, 3) if rate and ceiling else None))

    def mixed(self) -> None:
        args = self.args
        decoders = [*PERCENTILES, "--workload", "random", "--input-len", str(args.decoder_input_len), "--output-len",
                    str(args.decode_len), "--concurrency", str(args.decoders), "--duration", str(args.duration),
                    "--num-requests", str(args.decoders * args.max_rounds)]
        longs = [*PERCENTILES, "--workload", "random", "--input-len", str(args.long_len), "--output-len", str(args.long_output_len),
                 "--request-rate", str(args.long_rate), "--concurrency", str(max(1, args.decoders)),
                 "--duration", str(args.duration),
                 "--num-requests", str(math.ceil(args.long_rate * args.duration) + 1)]
        lines = {}
        for name, flags in (("plain", []), ("disaggregated", DISAGGREGATED)):
            with self.served(f"mixed-{name}", flags) as server, ThreadPoolExecutor(2) as pool:
                decoding = pool.submit(run_loadgen, server.url, decoders, args, self.out_dir / f"loadgen-{name}-decode.json")
                long_prompts = pool.submit(run_loadgen, server.url, longs, args, self.out_dir / f"loadgen-{name}-long.json")
                decode, long = decoding.result()["summary"], long_prompts.result()["summary"]
            itl = decode["itl_ms"] or {}
            lines[name] = self.emit(dict(
                row="mixed", server=name, decoders=args.decoders, decode_len=args.decode_len, long_len=args.long_len,
                long_rate=args.long_rate, duration_s=args.duration, decode_requests=decode["num_requests"],
                decode_failed=decode["num_failed"], long_requests=long["num_requests"], long_failed=long["num_failed"],
                itl_p50_ms=_round(itl.get("median")), itl_p99_ms=_round(itl.get("p99")),
                decode_output_tok_s=_round(decode["output_throughput"]),
                long_ttft_p50_ms=_round((long["ttft_ms"] or {}).get("median"))))
        plain, split = lines["plain"]["itl_p99_ms"], lines["disaggregated"]["itl_p99_ms"]
        self.emit(dict(row="mixed-summary", itl_p99_plain_over_disaggregated=round(plain / split, 3)
                       if plain and split else None))


def _round(value, digits: int = 2):
    return None if value is None else round(value, digits)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default=",".join(ROWS), help="transfer, mixed or both, comma-separated")
    parser.add_argument("--model", help="a model folder, a .gguf file or a built-in config (default: the default model)")
    parser.add_argument("--load-format", help="as spillway serve's (default: its own; dummy for a built-in config)")
    parser.add_argument("--tokenizer-dir", help="a built-in config's tokenizer (default: the default model's)")
    parser.add_argument("--device-args", default="", help="more `spillway serve` flags, e.g. '--kv-cache-dtype fp8'")
    parser.add_argument("--transfer-len", type=int, default=512, help="transfer row: prompt tokens")
    parser.add_argument("--transfer-rounds", type=int, default=4, help="transfer row: prompts, one at a time")
    parser.add_argument("--decoders", type=int, default=4, help="mixed row: decoding streams at once")
    parser.add_argument("--decoder-input-len", type=int, default=32)
    parser.add_argument("--decode-len", type=int, default=32, help="mixed row: tokens each decoding stream asks")
    parser.add_argument("--long-len", type=int, default=256, help="mixed row: a long prompt's tokens")
    parser.add_argument("--long-output-len", type=int, default=4)
    parser.add_argument("--long-rate", type=float, default=0.25, help="mixed row: long prompts a second")
    parser.add_argument("--duration", type=float, default=10.0, help="mixed row: seconds each load runs")
    parser.add_argument("--max-rounds", type=int, default=64,
                        help="mixed row: requests each decoding stream sends at most (loadgen draws its prompts up front)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds a request may take")
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument("--output-dir", help="keep every loadgen JSON and server log here (default: a temporary folder)")
    parser.add_argument("--results", help="append the JSON lines here too")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    rows = [row.strip() for row in args.rows.split(",") if row.strip()]
    if not rows or any(row not in ROWS for row in rows):
        parser.error(f"--rows takes a comma-separated list of {', '.join(ROWS)}; got {args.rows!r}")
    exit_on_sigterm()
    out_dir = Path(args.output_dir or tempfile.mkdtemp(prefix="disagg-bench-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        bench = Bench(args, model_args(args, model_folder(args, stack)), out_dir)
        for row in rows:
            getattr(bench, row)()
    log(f"loadgen results and server logs: {out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
