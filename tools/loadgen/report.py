"""Summaries of a run: latency distributions, throughput, goodput, the server's cache figures.

Latencies are in milliseconds, throughputs per second of the run's wall time (first request
sent to last request finished). Only successful requests count towards latencies, tokens and
throughput; failed ones are counted by kind.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass, field

from .client import RequestRecord
from .server_metrics import GaugeSample, ServerReport

RESULTS_VERSION = 1
DEFAULT_PERCENTILES = (90.0, 99.0)


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between closest ranks; NaN of none."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def percentile_name(q: float) -> str:
    """"p99", "p99.9": how a percentile is named in the report."""
    return f"p{q:g}"


@dataclass(slots=True)
class Distribution:
    mean: float
    median: float
    p90: float
    p99: float
    count: int
    # The percentiles asked for with --percentiles (vLLM bench's --metric-percentiles), by name.
    percentiles: dict[str, float] = field(default_factory=dict)

    @classmethod
    def of(cls, values: list[float], percentiles: tuple[float, ...] = DEFAULT_PERCENTILES) -> Distribution | None:
        if not values:
            return None
        return cls(sum(values) / len(values), percentile(values, 50), percentile(values, 90),
                   percentile(values, 99), len(values),
                   {percentile_name(q): percentile(values, q) for q in percentiles})


@dataclass(slots=True)
class Summary:
    num_requests: int
    num_ok: int
    num_failed: int
    duration_s: float
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    total_prompt_tokens: int
    total_output_tokens: int
    num_short_outputs: int  # finished with fewer output tokens than asked
    num_without_usage: int  # the server sent no usage: tokens counted from chunks
    ttft_ms: Distribution | None
    tpot_ms: Distribution | None
    itl_ms: Distribution | None
    e2e_ms: Distribution | None
    prompt_tokens: Distribution | None
    output_tokens: Distribution | None
    cached_prompt_fraction: float | None  # from usage.prompt_tokens_details.cached_tokens
    slo_ms: dict[str, float] = field(default_factory=dict)
    num_good: int | None = None
    goodput: float | None = None  # requests per second meeting every SLO
    errors: dict[str, int] = field(default_factory=dict)
    error_examples: dict[str, str] = field(default_factory=dict)
    server: ServerReport | None = None


def meets_slo(record: RequestRecord, slo_ms: dict[str, float]) -> bool:
    measured = {"ttft": record.ttft_s, "tpot": record.tpot_s, "e2e": record.e2e_s}
    for name, limit in slo_ms.items():
        value = measured[name]
        if name == "tpot" and value is None and record.ok:
            continue  # one output token: no time per output token to judge
        if value is None or value * 1000 > limit:
            return False
    return record.ok


def _prompt_tokens(record: RequestRecord) -> int:
    """The server's count; the loadgen's own measure when the server sent no usage."""
    return record.prompt_tokens if record.prompt_tokens is not None else record.expected_prompt_tokens


def summarize(records: list[RequestRecord], slo_ms: dict[str, float], server: ServerReport | None,
              percentiles: tuple[float, ...] = DEFAULT_PERCENTILES) -> Summary:
    ok = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    duration = max((r.start_s + (r.e2e_s or 0.0) for r in records), default=0.0)
    prompt_total = sum(_prompt_tokens(r) for r in ok)
    output_total = sum(r.output_tokens or 0 for r in ok)
    per_second = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
    with_cache = [r for r in ok if r.cached_tokens is not None and r.prompt_tokens]
    cached_fraction = (sum(r.cached_tokens for r in with_cache) / sum(r.prompt_tokens for r in with_cache)
                       if with_cache else None)
    examples: dict[str, str] = {}
    for r in failed:
        examples.setdefault(r.error_kind, r.error)
    summary = Summary(
        num_requests=len(records), num_ok=len(ok), num_failed=len(failed), duration_s=duration,
        request_throughput=per_second(len(ok)), output_throughput=per_second(output_total),
        total_token_throughput=per_second(prompt_total + output_total),
        total_prompt_tokens=prompt_total, total_output_tokens=output_total,
        num_short_outputs=sum(1 for r in ok if (r.output_tokens or 0) < r.expected_output_tokens),
        num_without_usage=sum(1 for r in ok if not r.usage_reported),
        ttft_ms=Distribution.of([r.ttft_s * 1000 for r in ok if r.ttft_s is not None], percentiles),
        tpot_ms=Distribution.of([r.tpot_s * 1000 for r in ok if r.tpot_s is not None], percentiles),
        itl_ms=Distribution.of([gap * 1000 for r in ok for gap in r.itl_s], percentiles),
        e2e_ms=Distribution.of([r.e2e_s * 1000 for r in ok], percentiles),
        prompt_tokens=Distribution.of([float(_prompt_tokens(r)) for r in ok], percentiles),
        output_tokens=Distribution.of([float(r.output_tokens) for r in ok if r.output_tokens is not None],
                                      percentiles),
        cached_prompt_fraction=cached_fraction, slo_ms=dict(slo_ms),
        errors=dict(Counter(r.error_kind for r in failed)), error_examples=examples, server=server)
    if slo_ms:
        summary.num_good = sum(1 for r in records if meets_slo(r, slo_ms))
        summary.goodput = per_second(summary.num_good)
    return summary


def results_document(config: dict, summary: Summary, records: list[RequestRecord],
                     samples: list[GaugeSample]) -> dict:
    """The JSON form of a run: what `--output` writes and what the tables and plots read."""
    return {
        "version": RESULTS_VERSION,
        "config": config,
        "summary": asdict(summary),
        "requests": [dict(asdict(r), tpot_s=r.tpot_s) for r in records],
        "server_samples": [asdict(s) for s in samples],
    }


def write_results(path: str, document: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(document, f, indent=1)
        f.write("\n")


def load_results(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        document = json.load(f)
    if document.get("version") != RESULTS_VERSION or "summary" not in document:
        raise ValueError(f"{path} is not a loadgen results file (version {RESULTS_VERSION})")
    return document
