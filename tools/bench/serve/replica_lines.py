"""The figures of tools/bench/serve/replicas.py, from loadgen's results documents and the server's
per-engine counters: one line per measured run, and a summary line per row with the ratios
against the baseline run of the same invocation."""

from __future__ import annotations

import statistics

from prometheus_client.parser import text_string_to_metric_families

from spillway.tools.loadgen.report import percentile

# Per-engine counters read from /metrics around a run: sample name -> field.
ENGINE_COUNTERS = {"vllm:prefix_cache_queries_total": "queries", "vllm:prefix_cache_hits_total": "hits",
                   "vllm:num_preemptions_total": "preemptions"}
ROUTED = "spillway:routed_requests_total"

Counters = dict[str, dict[str, float]]  # engine label -> field -> value


def parse_engine_counters(text: str) -> Counters:
    """Prometheus text -> each engine's ENGINE_COUNTERS fields and `routed_<reason>` (samples
    without an engine label are left out)."""
    engines: Counters = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            engine = sample.labels.get("engine")
            if engine is None:
                continue
            if sample.name in ENGINE_COUNTERS:
                field = ENGINE_COUNTERS[sample.name]
            elif sample.name == ROUTED:
                field = "routed_" + sample.labels["reason"]
            else:
                continue
            counters = engines.setdefault(engine, {})
            counters[field] = counters.get(field, 0.0) + sample.value
    return engines


def replica_figures(before: Counters, after: Counters) -> list[dict]:
    """Each replica's share of a run, by engine number: prefix-cache queries, hits and hit rate,
    preemptions, the requests routed to it by reason."""
    figures = []
    for engine in sorted(after, key=int):
        delta = {k: v - before.get(engine, {}).get(k, 0.0) for k, v in after[engine].items()}
        queries, hits = delta.get("queries", 0.0), delta.get("hits", 0.0)
        routed = {k.removeprefix("routed_"): int(v) for k, v in sorted(delta.items()) if k.startswith("routed_")}
        figures.append(dict(engine=engine, prefix_cache_queries=int(queries), prefix_cache_hits=int(hits),
                            hit_rate=_rounded(hits / queries if queries else None, 4),
                            preemptions=int(delta.get("preemptions", 0.0)), routed=routed))
    return figures


def ttft_p50_ms(requests: list[dict], later_turns: bool) -> float | None:
    """Median TTFT of the successful requests of turns 2+ (`later_turns`) or of first turns."""
    ttfts = [r["ttft_s"] for r in requests if r["ok"] and r["ttft_s"] is not None and (r["turn"] > 0) == later_turns]
    return round(percentile(ttfts, 50) * 1e3, 2) if ttfts else None


def measured_histories(requests: list[dict]) -> int:
    """Every conversation's tokens after its last answered turn: that turn's prompt and reply,
    as the server counted them (chat template included)."""
    last: dict[int, dict] = {}
    for r in requests:
        if r["ok"] and (r["conversation"] not in last or r["turn"] > last[r["conversation"]]["turn"]):
            last[r["conversation"]] = r
    return sum((r["prompt_tokens"] or 0) + (r["output_tokens"] or 0) for r in last.values())


def run_fields(document: dict) -> dict:
    """What every run's line gives: requests, failures, throughputs, duration."""
    summary = document["summary"]
    return dict(requests=summary["num_requests"], failed=summary["num_failed"],
                output_tok_s=round(summary["output_throughput"], 1),
                total_tok_s=round(summary["total_token_throughput"], 1), duration_s=round(summary["duration_s"], 2))


def routing_line(policy: str, round_index: int, document: dict, replicas: list[dict], workload: dict,
                 pool_tokens: int, stamp: dict) -> dict:
    """One routing run: `workload` (the run's sizes, the pool's blocks) as given, the histories
    as served and over one replica's pool, the server's hit rate, TTFT p50 of turns 2+ and of
    first turns, preemptions, each replica's figures."""
    server = document["summary"]["server"] or {}
    histories = measured_histories(document["requests"])
    return dict(row="routing", policy=policy, round=round_index, **workload, histories_tokens=histories,
                histories_per_pool=round(histories / pool_tokens, 3), **run_fields(document),
                prefix_cache_hit_rate=_rounded(server.get("prefix_cache_hit_rate"), 4),
                ttft_p50_ms=ttft_p50_ms(document["requests"], later_turns=True),
                ttft_p50_ms_first_turn=ttft_p50_ms(document["requests"], later_turns=False),
                preemptions=server.get("num_preemptions"), per_replica=replicas, **stamp)


def routing_summary(lines: list[dict], baseline: str, stamp: dict) -> dict:
    """Each policy's medians over the rounds, and the other policies' ratios against the
    baseline's, both higher-is-better: hit rate policy / baseline, TTFT p50 baseline / policy."""
    def median(policy: str, field: str, digits: int) -> float | None:
        values = [line[field] for line in lines if line["policy"] == policy and line[field] is not None]
        return round(statistics.median(values), digits) if values else None

    policies = list(dict.fromkeys(line["policy"] for line in lines))
    hit_rate = {p: median(p, "prefix_cache_hit_rate", 4) for p in policies}
    ttft = {p: median(p, "ttft_p50_ms", 2) for p in policies}
    others = [p for p in policies if p != baseline]
    return dict(row="routing-summary", baseline=baseline, rounds=len(lines) // len(policies), hit_rate=hit_rate,
                ttft_p50_ms=ttft, hit_rate_ratio={p: ratio(hit_rate[p], hit_rate[baseline]) for p in others},
                ttft_p50_ratio={p: ratio(ttft[baseline], ttft[p]) for p in others},
                failed=sum(line["failed"] for line in lines), **stamp)


def uniform_line(replicas: int, round_index: int, document: dict, workload: dict, stamp: dict) -> dict:
    ttft = document["summary"]["ttft_ms"]
    return dict(row="uniform", replicas=replicas, round=round_index, **workload, **run_fields(document),
                ttft_p50_ms=_rounded(ttft["median"] if ttft else None, 2), **stamp)


def uniform_summary(lines: list[dict], stamp: dict) -> dict:
    """Output tok/s of each replica count (median over the rounds) and 2 replicas' over 1's."""
    rate = {str(dp): round(statistics.median(line["output_tok_s"] for line in lines if line["replicas"] == dp), 1)
            for dp in (1, 2)}
    return dict(row="uniform-summary", baseline="1 replica", rounds=len(lines) // 2, output_tok_s=rate,
                ratio=ratio(rate["2"], rate["1"]), failed=sum(line["failed"] for line in lines), **stamp)


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    return round(numerator / denominator, 3) if numerator is not None and denominator else None


def _rounded(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)
