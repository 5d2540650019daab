"""tools/bench/tier/copy_runs.py's count for a tree without `block_runs`: only runs going up merge."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))

from spillway.tools.bench.tier.copy_runs import forward_runs  # noqa: E402


def test_a_copier_before_block_runs_merges_only_runs_going_up():
    assert forward_runs([]) == 0
    assert forward_runs([(0, 1), (1, 2), (2, 3), (5, 0)]) == 2
    assert forward_runs([(7, 3), (6, 2), (5, 1)]) == 3  # down: a copy each
