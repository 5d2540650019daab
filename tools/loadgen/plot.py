"""`--plot`: latency distributions and throughput over time, drawn from a results document.

Token arrival times are rebuilt from each request's start, TTFT and inter-token gaps, so the
throughput curve counts streamed chunks (one per token on servers that stream token by token).
"""

from __future__ import annotations

import math

from .report import percentile

DISTRIBUTION_PANELS = [("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("itl_s", "Inter-token latency"),
                       ("e2e_s", "E2E latency")]


def chunk_times(request: dict) -> list[float]:
    """Seconds from the run's start at which the request's text chunks arrived."""
    if not request["ok"] or request["ttft_s"] is None:
        return []
    times = [request["start_s"] + request["ttft_s"]]
    for gap in request["itl_s"]:
        times.append(times[-1] + gap)
    return times


def per_second(times: list[float], bin_s: float) -> tuple[list[float], list[float]]:
    if not times:
        return [], []
    bins = [0] * (int(max(times) / bin_s) + 1)
    for t in times:
        bins[int(t / bin_s)] += 1
    return [bin_s * (i + 0.5) for i in range(len(bins))], [count / bin_s for count in bins]


def draw(document: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    requests = document["requests"]
    ok = [r for r in requests if r["ok"]]
    figure, axes = plt.subplots(2, 3, figsize=(15, 8.5))
    config = document["config"]
    figure.suptitle(f"loadgen {config.get('workload')} against {config.get('url')}: {config.get('load')}")
    for axis, (key, title) in zip(axes.flat[:4], DISTRIBUTION_PANELS):
        values = [1000 * v for r in ok for v in (r[key] if key == "itl_s" else [r[key]]) if v is not None]
        axis.set_title(f"{title} (ms)")
        axis.set_xlabel("ms")
        axis.set_ylabel("count")
        axis.locator_params(axis="x", nbins=6)
        if values:
            axis.hist(values, bins=min(50, max(5, int(math.sqrt(len(values))) * 2)), color="tab:blue", alpha=0.8)
            for stat, style in (("median", "--"), ("p99", ":")):
                value = percentile(values, 50 if stat == "median" else 99)
                axis.axvline(value, color="black", linestyle=style, label=f"{stat} {value:.1f}")
            axis.legend(fontsize=8)
    duration = max((r["start_s"] + (r["e2e_s"] or 0.0) for r in requests), default=0.0)
    bin_s = max(duration / 60, 0.25)
    throughput = axes.flat[4]
    x, y = per_second([t for r in ok for t in chunk_times(r)], bin_s)
    throughput.plot(x, y, label="output chunks/s", color="tab:green")
    x, y = per_second([r["start_s"] + r["e2e_s"] for r in ok], bin_s)
    twin = throughput.twinx()
    twin.plot(x, y, label="finished requests/s", color="tab:orange")
    throughput.set_title("Throughput over time")
    throughput.set_xlabel("s since start")
    throughput.set_ylabel("output chunks/s")
    twin.set_ylabel("requests/s")
    throughput.legend(loc="upper left", fontsize=8)
    twin.legend(loc="upper right", fontsize=8)
    cache = axes.flat[5]
    samples = document.get("server_samples") or []
    for key, label, style in (("gpu_cache_usage", "GPU", "-"), ("cpu_cache_usage", "CPU", "-"),
                              ("kv_cache_usage", "kv_cache_usage_perc", "--")):
        points = [(s["t_s"], 100 * s["values"][key]) for s in samples if key in s["values"]]
        if points:
            cache.plot([p[0] for p in points], [p[1] for p in points], style, label=label)
    cache.set_title("KV cache usage (/metrics)")
    cache.set_xlabel("s since start")
    cache.set_ylabel("%")
    if cache.get_legend_handles_labels()[0]:
        cache.legend(fontsize=8)
    else:
        cache.text(0.5, 0.5, "no /metrics samples", ha="center", va="center", transform=cache.transAxes)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)

