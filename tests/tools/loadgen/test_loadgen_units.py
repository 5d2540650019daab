"""tools/loadgen's pure parts: lengths, SLOs, percentiles, /metrics parsing, arrivals, prompt fitting."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root holds `tools`

from spillway.tools.loadgen.cli import parse_slo  # noqa: E402
from spillway.tools.loadgen.client import RequestRecord  # noqa: E402
from spillway.tools.loadgen.corpus import LENGTH_SLACK, MAX_PROBES, TextPrompts, stdlib_words  # noqa: E402
from spillway.tools.loadgen.report import percentile, summarize  # noqa: E402
from spillway.tools.loadgen.runner import LoadShape, arrival_gaps  # noqa: E402
from spillway.tools.loadgen.server_metrics import parse_prometheus  # noqa: E402
from spillway.tools.loadgen.workloads import Lengths, Planner, WorkloadSpec  # noqa: E402


def record(index: int, ttft_s: float = 0.1, e2e_s: float = 1.0, output_tokens: int = 10, ok: bool = True,
           **fields) -> RequestRecord:
    return RequestRecord(index=index, conversation=index, turn=0, start_s=0.0, expected_prompt_tokens=5,
                         expected_output_tokens=output_tokens, ok=ok, ttft_s=ttft_s if ok else None, e2e_s=e2e_s,
                         prompt_tokens=5 if ok else None, output_tokens=output_tokens if ok else None,
                         usage_reported=ok, **fields)


def test_lengths_are_a_number_or_an_inclusive_range():
    assert Lengths.parse("128") == Lengths(128, 128)
    assert Lengths.parse("64:256") == Lengths(64, 256) and str(Lengths(64, 256)) == "64:256"
    for bad in ("0", "9:3", "x", "-4"):
        with pytest.raises(ValueError):
            Lengths.parse(bad)


def test_slo_names_are_checked():
    assert parse_slo("ttft=500,tpot=50") == {"ttft": 500.0, "tpot": 50.0}
    with pytest.raises(argparse.ArgumentTypeError):
        parse_slo("latency=3")


def test_percentiles_interpolate_between_ranks():
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([10.0], 99) == 10.0
    assert percentile(list(range(101)), 90) == 90


def test_prometheus_text_is_summed_over_label_sets_and_comments_skipped():
    text = ('# HELP vllm:prefix_cache_hits_total hits\n'
            'vllm:prefix_cache_hits_total{model_name="a"} 3.0\n'
            'vllm:prefix_cache_hits_total{model_name="b",x="}"} 4\n'
            'vllm:num_requests_running 2 1700000000\n'
            'vllm:weird{model_name="a"} NaN\n')
    assert parse_prometheus(text) == {"vllm:prefix_cache_hits_total": 7.0, 'vllm:prefix_cache_hits_total{x="}"}': 4.0,
                                      "vllm:num_requests_running": 2.0}


def test_fractions_are_averaged_over_engines_and_counts_summed():
    text = ('vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5\n'
            'vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.7\n'
            'vllm:num_requests_running{engine="0",model_name="m"} 3\n'
            'vllm:num_requests_running{engine="1",model_name="m"} 4\n'
            'vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.25\n')
    assert parse_prometheus(text) == pytest.approx({"vllm:kv_cache_usage_perc": 0.6, "vllm:num_requests_running": 7.0,
                                                    "vllm:gpu_cache_usage_perc": 0.25})


def test_the_cpu_tiers_counters_are_read_by_direction_and_source_over_every_engine():
    from spillway.tools.loadgen.server_metrics import COUNTERS

    text = ('# TYPE vllm:kv_offload_total_bytes counter\n'
            'vllm:kv_offload_total_bytes_total{engine="0",model_name="m",transfer_type="GPU_to_CPU"} 4000.0\n'
            'vllm:kv_offload_total_bytes_total{engine="1",model_name="m",transfer_type="GPU_to_CPU"} 96.0\n'
            'vllm:kv_offload_total_bytes_total{engine="0",model_name="m",transfer_type="CPU_to_GPU"} 1024.0\n'
            'vllm:kv_offload_total_bytes_created{engine="0",model_name="m",transfer_type="CPU_to_GPU"} 1.7e9\n'
            '# TYPE spillway:cached_tokens counter\n'
            'spillway:cached_tokens_total{engine="0",model_name="m",source="gpu"} 32.0\n'
            'spillway:cached_tokens_total{engine="0",model_name="m",source="cpu"} 288.0\n')
    values = parse_prometheus(text)
    read = {key: values.get(name) for key, name in COUNTERS.items()}
    assert read["offload_bytes_gpu_to_cpu"] == 4096 and read["offload_bytes_cpu_to_gpu"] == 1024
    assert read["cached_tokens_gpu"] == 32 and read["cached_tokens_cpu"] == 288
    assert read["cpu_tier_hits"] is None  # not exported: missing, never 0
    assert values["vllm:kv_offload_total_bytes_total"] == 5120


def test_goodput_counts_successful_requests_within_every_slo():
    records = [record(0, ttft_s=0.05, e2e_s=0.5), record(1, ttft_s=0.3, e2e_s=0.5),
               record(2, ttft_s=0.05, e2e_s=2.0), record(3, ok=False, e2e_s=0.1, error_kind="connect")]
    summary = summarize(records, {"ttft": 100, "tpot": 100}, None)
    assert summary.num_good == 1  # 1 misses TTFT, 2 misses TPOT (1.95 s / 9 tokens), 3 failed
    assert summary.goodput == pytest.approx(1 / 2.0)
    assert summary.errors == {"connect": 1} and summary.num_ok == 3
    assert summary.tpot_ms.median == pytest.approx(1000 * 0.45 / 9)


def test_gamma_arrivals_have_the_asked_mean_and_burstiness():
    for burstiness in (0.5, 1.0, 4.0):
        gaps = list(itertools.islice(arrival_gaps(10.0, burstiness, seed=0), 20_000))
        assert statistics.fmean(gaps) == pytest.approx(0.1, rel=0.03)
        coefficient_of_variation = statistics.pstdev(gaps) / statistics.fmean(gaps)
        assert coefficient_of_variation == pytest.approx(burstiness ** -0.5, rel=0.05)
    assert next(arrival_gaps(float("inf"), 1.0, 0)) == 0.0


def test_a_load_shape_must_end():
    with pytest.raises(ValueError):
        LoadShape(concurrency=4)
    assert LoadShape(concurrency=None, request_rate=2.0, duration_s=30).describe() == \
        "2 req/s (burstiness 1), 30 s"


class WordPieceCounter:
    """Counts a word of n letters as n // 4 + 1 tokens, like a subword tokenizer would, roughly."""

    def __init__(self) -> None:
        self.calls = 0

    async def count(self, text: str) -> int:
        self.calls += 1
        return sum(len(word) // 4 + 1 for word in text.split())


def test_prompt_text_fits_its_token_length_within_the_slack():
    words = stdlib_words()
    counter = WordPieceCounter()
    prompts = asyncio.run(TextPrompts.calibrate(words, counter))
    for start, num_tokens in ((0, 5), (17, 99), (5_000, 777), (9, 3000), (len(words) - 3, 50)):
        counter.calls = 0
        segment = asyncio.run(prompts.segment(start, num_tokens, "Question: "))
        assert segment.text.startswith("Question: ")
        measured = asyncio.run(counter.count(segment.text))
        assert segment.num_tokens == measured <= num_tokens
        num_words = len(segment.text.split()) - 1
        one_word_more = asyncio.run(counter.count(prompts.text(start, num_words + 1, "Question: ")))
        # within the slack, or the longest window that fits (a word may be several tokens)
        assert num_tokens - segment.num_tokens <= num_tokens // LENGTH_SLACK or one_word_more > num_tokens
        assert counter.calls <= MAX_PROBES + 2
    assert asyncio.run(prompts.segment(0, 1, "Question: ")).text == "Question: "  # the lead alone is longer


def test_a_seed_fixes_the_plan_and_shared_prefixes_are_reused():
    spec = WorkloadSpec("shared-prefix", Lengths(8, 64), Lengths(1, 9), num_prefixes=3, seed=7)
    first, second = Planner(spec, 10_000), Planner(spec, 10_000)
    assert [first.plan() for _ in range(5)] == [second.plan() for _ in range(5)]
    other = Planner(WorkloadSpec("shared-prefix", Lengths(8, 64), Lengths(1, 9), num_prefixes=3, seed=8), 10_000)
    assert other.prefixes != first.prefixes
    planner = Planner(spec, 10_000)
    systems = {planner.plan().system for _ in range(40)}
    assert systems == set(planner.prefixes) and len(systems) == 3


def test_think_times_are_drawn_per_turn_after_the_first_and_leave_plans_without_them_as_they_were():
    plain = WorkloadSpec("multi-turn", Lengths(8, 64), Lengths(1, 9), num_turns=3, seed=7)
    thinking = WorkloadSpec("multi-turn", Lengths(8, 64), Lengths(1, 9), num_turns=3, seed=7, think_time_s=2.0)
    first_plain, first_thinking = Planner(plain, 10_000).plan(), Planner(thinking, 10_000).plan()
    assert first_plain.think_s == [] and first_thinking.turns == first_plain.turns
    assert first_thinking.think_s[0] == 0.0 and len(first_thinking.think_s) == 3
    assert [Planner(thinking, 10_000).plan().think_s for _ in range(2)] == [first_thinking.think_s] * 2  # seeded
    planner = Planner(thinking, 10_000)
    waits = [wait for _ in range(1000) for wait in planner.plan().think_s[1:]]
    assert min(waits) > 0 and statistics.mean(waits) == pytest.approx(2.0, rel=0.1)  # exponential, mean 2 s


def test_a_json_schema_file_becomes_a_strict_response_format_and_a_bad_one_a_clear_error(tmp_path):
    from spillway.tools.loadgen.cli import json_schema_format

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    good, listed, broken = tmp_path / "good.json", tmp_path / "listed.json", tmp_path / "broken.json"
    good.write_text(json.dumps(schema))
    listed.write_text("[1, 2]")
    broken.write_text("{not json")
    assert json_schema_format(str(good)) == {"type": "json_schema",
                                             "json_schema": {"name": "answer", "schema": schema, "strict": True}}
    with pytest.raises(ValueError, match="listed.json: a JSON schema is an object, not list"):
        json_schema_format(str(listed))
    with pytest.raises(ValueError, match="broken.json"):
        json_schema_format(str(broken))
    with pytest.raises(ValueError, match="missing.json"):
        json_schema_format(str(tmp_path / "missing.json"))
