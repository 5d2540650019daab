"""tools/bench/engine/stats.py on a small pool: the state it builds, and its report."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(ROOT))

from spillway.tools.bench.engine.stats import build_state  # noqa: E402


def test_the_state_holds_running_requests_and_cached_blocks():
    manager, scheduler = build_state(num_blocks=2000, num_requests=20)
    manager.check_invariants()
    # 20 prompts of 800 tokens, 50 full blocks each, all cached: the 10 still running hold
    # theirs, the 10 finished left theirs free.
    assert (scheduler.num_running, manager.num_free_blocks, manager.num_cached_blocks) == (10, 1500, 1000)


def test_the_report_prints_both_timings_and_their_ratio():
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "bench" / "engine" / "stats.py"), "--num-blocks", "4000",
                             "--repeat", "2"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "4000 blocks" in lines[0]
    assert [line.split(":")[0].strip() for line in lines[1:]] == [
        "stats() routine report", "check_invariants() alone", "stats() with the check (asked)",
        "ratio check / routine report"]
