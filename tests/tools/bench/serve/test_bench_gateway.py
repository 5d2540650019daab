"""tools/bench/serve/gateway_alone.py on a tiny shape: bursts against one gateway, CPU per request, and the
arrivals the fake worker records."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]


def test_a_run_of_bursts_reports_cpu_per_request_and_the_arrivals_spread():
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "bench" / "serve" / "gateway_alone.py"), "--streams", "3",
                             "--prompt-len", "40", "--output-len", "2", "--step-ms", "2", "--bursts", "2",
                             "--repeats", "1"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("3 streams x (40/2) x 2 bursts")
    row = re.search(r"this tree: .* = (\d+) us/request, .* arrivals over ([\d.]+) ms, slowest first token "
                    r"([\d.]+) ms", lines[1])
    assert row is not None, lines[1]
    spread, slowest = float(row[2]), float(row[3])
    assert 0 <= spread < slowest  # the last request arrived before the slowest first token came back


def test_held_preconnected_bursts_report_the_way_in_against_a_lone_request():
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "bench" / "serve" / "gateway_alone.py"), "--streams", "3",
                             "--prompt-len", "40", "--output-len", "2", "--step-ms", "2", "--bursts", "2",
                             "--repeats", "1", "--hold-ms", "20", "--preconnect"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    row = re.search(r"first token p50 ([\d.]+) ms against ([\d.]+) alone .*; first send to first arrival "
                    r"([\d.]+) ms against ([\d.]+) alone", result.stdout)
    assert row is not None, result.stdout
    burst_ttft, alone_ttft, burst_way_in, alone_way_in = map(float, row.groups())
    assert 20 <= alone_ttft and 20 <= burst_ttft  # the hold is in both
    assert 0 <= alone_way_in and alone_way_in + 20 <= alone_ttft  # one clock: the hold starts at the arrival
    assert 0 <= burst_way_in < burst_ttft


def test_zero_bursts_exit_2_naming_the_flag():
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "bench" / "serve" / "gateway_alone.py"), "--bursts", "0"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "--bursts must be at least 1" in result.stderr
