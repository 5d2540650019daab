"""tools/loadgen's --percentiles (vLLM bench's --metric-percentiles): parsed, computed for
every distribution, and printed as columns of the summary table."""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root holds `tools`

from spillway.tools.loadgen.cli import build_parser, parse_percentiles  # noqa: E402
from spillway.tools.loadgen.client import RequestRecord  # noqa: E402
from spillway.tools.loadgen.report import summarize  # noqa: E402
from spillway.tools.loadgen.table import format_summary  # noqa: E402


def records(count: int) -> list[RequestRecord]:
    """Requests whose TTFT is 1, 2, ..., count ms."""
    return [RequestRecord(index=i, conversation=i, turn=0, start_s=0.0, expected_prompt_tokens=5,
                          expected_output_tokens=3, ok=True, ttft_s=(i + 1) / 1000, e2e_s=0.5, prompt_tokens=5,
                          output_tokens=3, usage_reported=True) for i in range(count)]


def test_percentiles_are_parsed_as_vllm_bench_takes_them():
    assert parse_percentiles("50,90,99") == (50.0, 90.0, 99.0)
    assert parse_percentiles("99.9") == (99.9,)
    for bad in ("", "fifty", "0", "101", "50,,99"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_percentiles(bad)
    assert build_parser().parse_args(["--url", "http://x", "--percentiles", "25,75"]).percentiles == (25.0, 75.0)
    assert build_parser().parse_args(["--url", "http://x"]).percentiles == (90.0, 99.0)


def test_the_report_has_a_column_for_each_percentile_asked_for():
    summary = summarize(records(101), {}, None, percentiles=(50.0, 75.0, 99.9))
    assert summary.ttft_ms.percentiles == pytest.approx({"p50": 51.0, "p75": 76.0, "p99.9": 100.9})
    table = format_summary({"config": {"workload": "random"}, "summary": asdict(summary)})
    header = next(line for line in table.splitlines() if "median" in line)
    assert header.split() == ["mean", "median", "p50", "p75", "p99.9"]
    ttft_row = next(line for line in table.splitlines() if line.startswith("TTFT (ms)"))
    assert ttft_row.split()[-3:] == ["51.00", "76.00", "100.90"]


def test_a_results_file_saved_before_percentiles_still_prints_p90_and_p99():
    summary = asdict(summarize(records(10), {}, None))
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms", "prompt_tokens", "output_tokens"):
        if summary[key] is not None:
            del summary[key]["percentiles"]
    header = next(line for line in format_summary({"config": {}, "summary": summary}).splitlines()
                  if "median" in line)
    assert header.split() == ["mean", "median", "p90", "p99"]
