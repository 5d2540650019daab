"""Plain-text tables: one run's summary, and two runs side by side with ratios.

Both read the JSON form of a run (what `--output` writes), so a live run and a saved one print
the same way.
"""

from __future__ import annotations

DISTRIBUTIONS = [("ttft_ms", "TTFT (ms)"), ("tpot_ms", "TPOT (ms)"), ("itl_ms", "ITL (ms)"),
                 ("e2e_ms", "E2E latency (ms)"), ("prompt_tokens", "Prompt tokens"),
                 ("output_tokens", "Output tokens")]
STATS = ("mean", "median", "p90", "p99")
WIDTH = 72
FEW_SAMPLES = 20  # below this many, a p90/p99 is little more than the maximum


def _get(document: dict, path: str):
    value = document
    for key in path.split("."):
        if not isinstance(value, dict) or value.get(key) is None:
            return None
        value = value[key]
    return value


def _number(value, digits: int = 2) -> str:
    if value is None:
        return "-"
    return f"{value:,}" if isinstance(value, int) else f"{value:,.{digits}f}"


def _count(value) -> str:
    return "-" if value is None else f"{round(value):,}"


def _percent(value) -> str:
    return "-" if value is None else f"{100 * value:.1f} %"


def describe_run(config: dict) -> list[tuple[str, str]]:
    endpoint = config.get("endpoint", "?")
    return [("Server", config.get("url", "?")),
            ("Model", f"{config.get('model') or '(server default)'} via "
                      f"/v1/{'chat/' if endpoint == 'chat' else ''}completions"),
            ("Workload", config.get("workload_description", config.get("workload", "?"))),
            ("Load", config.get("load", "?")),
            ("Prompts", config.get("prompt_source", "?"))]


def format_summary(document: dict) -> str:
    config, s = document["config"], document["summary"]
    title = f" loadgen: {config.get('workload', '?')} "
    lines = [title.center(WIDTH, "=")]
    rows = describe_run(config) + [
        ("Requests", f"{s['num_ok']} ok, {s['num_failed']} failed, {s['num_requests']} sent"),
        ("Duration", f"{s['duration_s']:.2f} s"),
        ("Request throughput", f"{_number(s['request_throughput'], 3)} req/s"),
        ("Output token throughput", f"{_number(s['output_throughput'])} tok/s"),
        ("Total token throughput", f"{_number(s['total_token_throughput'])} tok/s"),
    ]
    if s.get("slo_ms"):
        slo = ", ".join(f"{k} <= {v:g} ms" for k, v in s["slo_ms"].items())
        rows.append(("Goodput", f"{_number(s['goodput'], 3)} req/s ({s['num_good']} of {s['num_requests']} "
                                f"requests meet {slo})"))
    lines += [f"{label:<28}{value}" for label, value in rows]
    lines.append("-" * WIDTH)
    columns = _columns(s)
    lines.append(f"{'':<20}" + "".join(f"{name:>13}" for name in columns))
    for key, label in DISTRIBUTIONS:
        dist = s.get(key)
        cells = "".join(f"{_number(_stat(dist, name)):>13}" for name in columns)
        lines.append(f"{label:<20}{cells}")
    fewest = min((s[key]["count"] for key, _ in DISTRIBUTIONS[:4] if s.get(key)), default=None)
    if fewest is not None and fewest < FEW_SAMPLES:
        lines.append(f"(p90 and p99 rest on {fewest} samples, fewer than {FEW_SAMPLES}: "
                     "they are the largest values seen, not a tail)")
    lines.append("-" * WIDTH)
    lines += [f"{label:<28}{value}" for label, value in _server_rows(s)]
    for kind, count in sorted(s.get("errors", {}).items()):
        lines.append(f"{'Errors: ' + kind:<28}{count}  e.g. {s['error_examples'].get(kind, '')[:120]}")
    if s.get("num_short_outputs"):
        lines.append(f"{'Short outputs':<28}{s['num_short_outputs']} requests got fewer tokens than asked "
                     "(the server may not honour ignore_eos / min_tokens)")
    if s.get("num_without_usage"):
        lines.append(f"{'Without usage':<28}{s['num_without_usage']} requests: tokens counted from chunks")
    lines.append("=" * WIDTH)
    return "\n".join(lines)


def _columns(s: dict) -> list[str]:
    """mean, median and the run's --percentiles (p90 and p99 for a run saved before them)."""
    for key, _ in DISTRIBUTIONS:
        if s.get(key) and s[key].get("percentiles"):
            return ["mean", "median", *s[key]["percentiles"]]
    return list(STATS)


def _stat(dist: dict | None, name: str) -> float | None:
    if not dist:
        return None
    return dist[name] if name in ("mean", "median") else dist.get("percentiles", {}).get(name, dist.get(name))


def _server_rows(s: dict) -> list[tuple[str, str]]:
    server = s.get("server")
    rows = [("Cached prompt tokens", f"{_percent(s.get('cached_prompt_fraction'))} (from usage)")]
    if server is None:
        return rows + [("Server metrics", "unavailable (no /metrics)")]
    hit_rate = server.get("prefix_cache_hit_rate")
    if hit_rate is not None:
        rows.insert(0, ("Prefix cache hit rate", f"{_percent(hit_rate)} ({_count(server['prefix_cache_hits'])} of "
                                                 f"{_count(server['prefix_cache_queries'])} tokens, /metrics)"))
    tiers = ", ".join(f"{name} {_percent(server.get(key))}" for name, key in
                      (("GPU", "gpu_cache_usage_peak"), ("CPU", "cpu_cache_usage_peak")) if server.get(key) is not None)
    peak = _percent(server.get("kv_cache_usage_peak"))
    rows.append(("KV cache usage peak", f"{peak} ({tiers})" if tiers else peak))
    rows.append(("Requests running peak", f"{_count(server.get('num_running_peak'))}, "
                                          f"waiting peak {_count(server.get('num_waiting_peak'))}"))
    rows.append(("Preemptions", _count(server.get("num_preemptions"))))
    if server.get("cached_tokens_cpu") is not None:
        rows.append(("Cached tokens by tier", f"GPU {_count(server.get('cached_tokens_gpu'))}, "
                                              f"CPU {_count(server.get('cached_tokens_cpu'))}"))
    if server.get("offload_bytes_gpu_to_cpu") is not None or server.get("offload_bytes_cpu_to_gpu") is not None:
        rows.append(("KV offload traffic", f"{_gib(server.get('offload_bytes_gpu_to_cpu'))} to CPU, "
                                           f"{_gib(server.get('offload_bytes_cpu_to_gpu'))} back to GPU"))
    rows.append(("Server token counters", f"{_count(server.get('prompt_tokens'))} prompt, "
                                          f"{_count(server.get('generation_tokens'))} generated "
                                          f"(usage: {s['total_prompt_tokens']:,}, {s['total_output_tokens']:,})"))
    return rows


COMPARE_ROWS = [  # (label, path in the summary, how to print it)
    ("Requests ok", "num_ok", "count"), ("Requests failed", "num_failed", "count"),
    ("Duration (s)", "duration_s", "number"), ("Request throughput (req/s)", "request_throughput", "number"),
    ("Output tokens/s", "output_throughput", "number"), ("Total tokens/s", "total_token_throughput", "number"),
    ("Goodput (req/s)", "goodput", "number"),
    *[(f"{label.replace(' (ms)', '')} {stat} (ms)", f"{key}.{stat}", "number")
      for key, label in DISTRIBUTIONS[:4] for stat in STATS],
    ("Prefix cache hit rate", "server.prefix_cache_hit_rate", "percent"),
    ("Cached prompt tokens", "cached_prompt_fraction", "percent"),
    ("KV cache usage peak", "server.kv_cache_usage_peak", "percent"),
    ("GPU cache usage peak", "server.gpu_cache_usage_peak", "percent"),
    ("CPU cache usage peak", "server.cpu_cache_usage_peak", "percent"),
    ("Preemptions", "server.num_preemptions", "count"),
    ("Cached tokens from the CPU tier", "server.cached_tokens_cpu", "count"),
    ("KV offloaded to CPU (bytes)", "server.offload_bytes_gpu_to_cpu", "count"),
    ("KV restored to GPU (bytes)", "server.offload_bytes_cpu_to_gpu", "count"),
]
def _gib(value: float | None) -> str:
    return "-" if value is None else f"{value / 2**30:,.2f} GiB"


_FORMATS = {"count": _count, "number": lambda value: _number(value, 3), "percent": _percent}


def format_compare(a: dict, b: dict, name_a: str, name_b: str) -> str:
    lines = []
    for tag, name, document in (("A", name_a, a), ("B", name_b, b)):
        config = document["config"]
        lines.append(f"{tag}: {name} ({config.get('date', 'undated')})")
        lines += [f"   {label:<10}{value}" for label, value in describe_run(config)[1:4]]
    lines.append("-" * 80)
    lines.append(f"{'':<34}{'A':>15}{'B':>15}{'B / A':>12}")
    for label, path, kind in COMPARE_ROWS:
        value_a, value_b = _get(a["summary"], path), _get(b["summary"], path)
        if value_a is None and value_b is None:
            continue
        ratio = f"{value_b / value_a:.3f}" if value_a and value_b is not None else "-"
        show = _FORMATS[kind]
        lines.append(f"{label:<34}{show(value_a):>15}{show(value_b):>15}{ratio:>12}")
    return "\n".join(lines)
