"""`spillway bench serve`'s results under `vllm bench serve`'s names: the printed table and the
`--save-result` JSON, read from a loadgen results document (tools/loadgen/report.py).

Scripts that read vLLM's output (`Request throughput (req/s):`, `mean_ttft_ms`, `p99_itl_ms`)
read these the same way. Latencies are of successful requests only, in milliseconds; the
standard deviation is the population's, as numpy's default.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

WIDTH = 50
TITLES = {"ttft": ("Time to First Token", "TTFT"), "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
          "itl": ("Inter-token Latency", "ITL"), "e2el": ("End-to-end Latency", "E2EL")}


def latencies_ms(records: list[dict], metric: str) -> list[float]:
    ok = [r for r in records if r["ok"]]
    if metric == "itl":
        return [gap * 1000 for r in ok for gap in r["itl_s"]]
    key = {"ttft": "ttft_s", "tpot": "tpot_s", "e2el": "e2e_s"}[metric]
    return [r[key] * 1000 for r in ok if r[key] is not None]


def percentile(values: list[float], q: float) -> float:
    """Linear between closest ranks (numpy's default); 0 of none, as vLLM reports an empty one."""
    if not values:
        return 0.0
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def metric_stats(values: list[float], percentiles: list[float]) -> dict[str, float]:
    """{"mean": ..., "median": ..., "std": ..., "p99": ...}"""
    mean = sum(values) / len(values) if values else 0.0
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values)) if values else 0.0
    stats = {"mean": mean, "median": percentile(values, 50), "std": std}
    for q in percentiles:
        stats[f"p{q:g}"] = percentile(values, q)
    return stats


def percentiles_of(args: argparse.Namespace) -> list[float]:
    return [float(q) for q in args.metric_percentiles.split(",")]


def result_fields(document: dict, args: argparse.Namespace, shown: list[str]) -> dict:
    """The figures under vLLM's JSON names."""
    summary, records = document["summary"], document["requests"]
    fields = {"duration": summary["duration_s"], "completed": summary["num_ok"], "failed": summary["num_failed"],
              "total_input_tokens": summary["total_prompt_tokens"],
              "total_output_tokens": summary["total_output_tokens"],
              "request_throughput": summary["request_throughput"],
              "request_goodput": summary["goodput"] if args.goodput else None,
              "output_throughput": summary["output_throughput"],
              "total_token_throughput": summary["total_token_throughput"]}
    for metric in shown:
        for name, value in metric_stats(latencies_ms(records, metric), percentiles_of(args)).items():
            fields[f"{name}_{metric}_ms"] = value
    return fields


def _line(label: str, value) -> str:
    text = f"{value:.2f}" if isinstance(value, float) else str(value)
    return f"{label:<40} {text:<10}"


def format_result(document: dict, args: argparse.Namespace, shown: list[str]) -> str:
    fields = result_fields(document, args, shown)
    lines = [f"{' Serving Benchmark Result ':=^{WIDTH}}",
             _line("Successful requests:", fields["completed"]), _line("Failed requests:", fields["failed"])]
    if args.max_concurrency is not None:
        lines.append(_line("Maximum request concurrency:", args.max_concurrency))
    lines += [_line("Request rate configured (RPS):", float(args.request_rate)),
              _line("Benchmark duration (s):", fields["duration"]),
              _line("Total input tokens:", fields["total_input_tokens"]),
              _line("Total generated tokens:", fields["total_output_tokens"]),
              _line("Request throughput (req/s):", fields["request_throughput"])]
    if fields["request_goodput"] is not None:
        lines.append(_line("Request goodput (req/s):", fields["request_goodput"]))
    lines += [_line("Output token throughput (tok/s):", fields["output_throughput"]),
              _line("Total Token throughput (tok/s):", fields["total_token_throughput"])]
    for metric in shown:
        title, short = TITLES[metric]
        lines.append(f"{title:-^{WIDTH}}")
        lines.append(_line(f"Mean {short} (ms):", fields[f"mean_{metric}_ms"]))
        lines.append(_line(f"Median {short} (ms):", fields[f"median_{metric}_ms"]))
        for q in percentiles_of(args):
            lines.append(_line(f"P{q:g} {short} (ms):", fields[f"p{q:g}_{metric}_ms"]))
    if document["summary"]["errors"]:
        lines.append(_line("Errors by kind:", ", ".join(f"{kind} {count}" for kind, count
                                                          in sorted(document["summary"]["errors"].items()))))
    lines.append("=" * WIDTH)
    return "\n".join(lines)


def result_document(document: dict, args: argparse.Namespace, shown: list[str]) -> dict:
    config, records = document["config"], document["requests"]
    result = {"date": time.strftime("%Y%m%d-%H%M%S"), "backend": args.backend, "label": args.label,
              "endpoint_type": config["endpoint"], "model_id": config["model"], "tokenizer_id": config["model"],
              "num_prompts": args.num_prompts,
              "request_rate": args.request_rate if not math.isinf(args.request_rate) else "inf",
              "burstiness": args.burstiness, "max_concurrency": args.max_concurrency,
              "loadgen_command": config["command"], **result_fields(document, args, shown)}
    for item in args.metadata or []:
        key, _, value = item.partition("=")  # each has one: bench_serve.refusals
        result[key.strip()] = value.strip()
    if args.save_detailed:
        result.update(input_lens=[r["prompt_tokens"] if r["prompt_tokens"] is not None else r["expected_prompt_tokens"]
                                  for r in records],
                      output_lens=[r["output_tokens"] or 0 for r in records],
                      ttfts=[r["ttft_s"] or 0.0 for r in records], itls=[r["itl_s"] for r in records],
                      errors=[r["error"] or "" for r in records])
    return result


def result_path(args: argparse.Namespace, model: str | None) -> Path:
    if args.result_filename:
        name = args.result_filename
    else:
        concurrency = f"-concurrency{args.max_concurrency}" if args.max_concurrency is not None else ""
        model_id = (model or "model").split("/")[-1]
        name = f"{args.label or args.backend}-{args.request_rate}qps{concurrency}-{model_id}-" \
               f"{time.strftime('%Y%m%d-%H%M%S')}.json"
    return Path(args.result_dir or ".") / name


def save_result(document: dict, args: argparse.Namespace, shown: list[str]) -> Path:
    path = result_path(args, document["config"]["model"])
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(result_document(document, args, shown), f, indent=1)
        f.write("\n")
    return path
