"""tools/bench/tier/admission.py: the worker's intake and admission of a burst on a prefix held by
the CPU tier alone, timed in a child that imports the tree asked for, and its report."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(ROOT))

from spillway.tools.bench.tier.admission import PIECES, time_burst  # noqa: E402


def test_a_burst_on_a_cpu_held_prefix_is_timed_per_request():
    """Every request of the burst waits for the one shared load (else the run fails: the prefix
    was not in the CPU tier alone), every piece is timed, the run ends once each has its first
    token, and a lone request on the prefix is timed beside it."""
    times = time_burst(prompt_len=64, burst=3, rounds=1)
    assert list(times) == list(PIECES)
    assert all(times[name] > 0 for name in PIECES)
    assert times["total"] == times["intake"] + times["admission"] + times["compute"]
    # the burst's last first token comes after all its pieces; each piece is per request
    assert times["burst_ms"] * 1e3 >= 3 * times["total"] * 0.999


def test_the_report_has_a_row_per_tree_and_their_ratio():
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "bench" / "tier" / "admission.py"), "--prompt-len", "64",
                             "--burst", "3", "--repeats", "1", "--rounds", "1", "--baseline", str(ROOT)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("3 requests on a 64-token prefix held by the CPU tier alone") and ", cpu, a tiny random Llama;" in lines[0]
    assert lines[1].split() == list(PIECES)
    assert [line.split()[0] for line in lines[2:]] == ["baseline", "this", "ratio"]


def test_bad_counts_exit_2_naming_the_flags():
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "bench" / "tier" / "admission.py"), "--burst", "0"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "--burst, --repeats and --rounds must be at least 1" in result.stderr
