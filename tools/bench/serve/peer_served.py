"""Served throughput of one workload through an engine's `serve` command: `spillway serve`, or
`vllm serve` where vLLM is installed, measured by tools/loadgen.

    python tools/bench/engine/peer_offline.py --build qwen3-30b-a3b --tokenizer-dir tok --model /tmp/models
    python tools/bench/serve/peer_served.py --engine spillway --model /tmp/models/qwen3-30b-a3b
    python tools/bench/serve/peer_served.py --engine vllm --vllm-path /tmp/vsite --model /tmp/models/qwen3-30b-a3b

Both servers get the same flags (`--load-format dummy --kv-cache-dtype ... --max-num-seqs ...
--max-model-len INPUT+OUTPUT --gpu-memory-utilization ...`: vLLM's names, which Spillway
shares) and the same load: `--num-requests` completions of `--input-len` prompt tokens (text
measured by the server's own /tokenize), each asking exactly `--output-len` tokens with EOS
ignored, all sent at once. `--rows free,structured` runs the load twice on one server: free, then
held to a JSON schema (OpenAI's response_format, the long schema of
tools/bench/engine/structured.py, which no answer closes within 2,000 tokens, so lengths stay
exact with EOS not ignored). Prints one JSON line a row (appended to `--results` too): output
and total tok/s, output tokens a request, requests failed, the loadgen summary's TTFT and TPOT
medians; `--output-dir` keeps each run's loadgen JSON and server log. Run the two back to back on one machine and the same folder.
vLLM runs from a temporary working directory: its model inspection starts a child with the
working directory on its path, where this checkout's kernels/ would pass for another package.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from spillway.tools.bench.engine.structured import LONG_SCHEMA
from spillway.tools.bench.serve.server_process import Server

ENGINES = ("spillway", "vllm")


def server_command(args) -> tuple[list[str], dict[str, str] | None, Path | None]:
    """(program, environment, working directory) of the engine's `serve`."""
    if args.engine == "spillway":
        return [sys.executable, "-m", "spillway.gateway.cli.main"], None, None
    env = dict(os.environ)
    if args.vllm_path:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [args.vllm_path, env.get("PYTHONPATH")]))
    return [sys.executable, "-m", "vllm.entrypoints.cli.main"], env, Path(tempfile.mkdtemp(prefix="peer-served-"))


def serve_args(args) -> list[str]:
    return [args.model, "--load-format", args.load_format, "--kv-cache-dtype", args.kv_cache_dtype,
            "--max-num-seqs", str(args.max_num_seqs), "--max-model-len", str(args.input_len + args.output_len),
            "--gpu-memory-utilization", str(args.gpu_memory_utilization)]


ROWS = ("free", "structured")


def load(url: str, args, results: Path, row: str) -> dict:
    """tools/loadgen against `url`, all requests at once; its saved summary."""
    command = [sys.executable, "-m", "spillway.tools.loadgen", "--url", url, "--endpoint", "completions",
               "--workload", "random", "--input-len", str(args.input_len), "--output-len", str(args.output_len),
               "--num-requests", str(args.num_requests), "--concurrency", str(args.num_requests),
               "--seed", str(args.seed), "--no-progress",
               "--timeout", str(args.timeout), "--output", str(results)]
    if row == "structured":
        schema = results.with_name("schema.json")
        schema.write_text(json.dumps(LONG_SCHEMA))
        command += ["--json-schema", str(schema), "--no-ignore-eos"]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0 or not results.is_file():
        raise SystemExit(f"loadgen failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    print(done.stdout, flush=True)
    return json.loads(results.read_text())["summary"]


def run(args) -> list[dict]:
    if not (Path(args.model) / "config.json").is_file():
        raise SystemExit(f"--model {args.model!r} must be a folder holding config.json (both engines load it)")
    out_dir = Path(args.output_dir or tempfile.mkdtemp(prefix="peer-served-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    program, env, cwd = server_command(args)
    started = time.perf_counter()
    lines = []
    with Server(serve_args(args), args.startup_timeout, keep_log=out_dir / f"server-{args.engine}.log",
                program=program, env=env, cwd=cwd) as server:
        ready_s = time.perf_counter() - started
        for row in args.rows:
            summary = load(server.url, args, out_dir / f"loadgen-{args.engine}-{row}.json", row)
            lines.append(_line(args, row, summary, ready_s))
    return lines


def _line(args, row: str, summary: dict, ready_s: float) -> dict:
    medians = {name: round(summary[name]["median"], 3) if summary.get(name) else None for name in ("ttft_ms", "tpot_ms")}
    ok = max(summary["num_ok"], 1)
    return dict(engine=args.engine, row=row, model=args.model, requests=args.num_requests, input_len=args.input_len,
                output_len=args.output_len, kv_cache_dtype=args.kv_cache_dtype, max_num_seqs=args.max_num_seqs,
                failed=summary["num_failed"], output_tok_s=round(summary["output_throughput"], 1),
                total_tok_s=round(summary["total_token_throughput"], 1), duration_s=round(summary["duration_s"], 2),
                output_tokens_per_request=round(summary["total_output_tokens"] / ok, 1),
                startup_s=round(ready_s, 1), **{f"{name}_p50": value for name, value in medians.items()})


def _rows(text: str) -> list[str]:
    rows = [row for row in text.split(",") if row]
    unknown = [row for row in rows if row not in ROWS]
    if unknown or not rows:
        raise argparse.ArgumentTypeError(f"rows are {', '.join(ROWS)}; not {', '.join(unknown) or 'none'}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=ENGINES, default="spillway")
    parser.add_argument("--model", required=True, help="a model folder (config.json, tokenizer; weights or dummy)")
    parser.add_argument("--vllm-path", help="with --engine vllm: a folder to put first on the server's PYTHONPATH")
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--num-requests", type=int, default=1000)
    parser.add_argument("--input-len", type=int, default=1000)
    parser.add_argument("--output-len", type=int, default=1000)
    parser.add_argument("--max-num-seqs", type=int, default=512)
    parser.add_argument("--kv-cache-dtype", default="fp8")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds a request may take")
    parser.add_argument("--startup-timeout", type=float, default=600.0, help="seconds the server may take to start")
    parser.add_argument("--output-dir", help="keep the loadgen JSON and the server log here")
    parser.add_argument("--rows", type=_rows, default=["free"], help="free, structured or both (default free)")
    parser.add_argument("--results", help="append the JSON lines here too")
    args = parser.parse_args()
    if min(args.num_requests, args.input_len, args.output_len, args.max_num_seqs) < 1:
        parser.error("--num-requests, --input-len, --output-len and --max-num-seqs must be positive")
    for line in map(json.dumps, run(args)):
        print(line, flush=True)
        if args.results:
            with open(args.results, "a") as out:
                out.write(line + "\n")


if __name__ == "__main__":
    main()
