"""tools/bench/serve/intake.py: the intake's pieces timed in a child that imports the tree asked for,
and its report against a baseline tree."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(ROOT))

from spillway.tools.bench.serve.intake import PIECES, finished, time_pieces  # noqa: E402


def test_finished_gives_a_coroutines_value_and_refuses_one_that_waits():
    class Pause:
        def __await__(self):
            yield

    async def at_once():
        return 7

    async def waits():
        await Pause()
        return 8

    assert finished(at_once()) == 7
    with pytest.raises(RuntimeError, match="suspended"):
        finished(waits())


def test_every_piece_is_timed_and_the_total_is_their_sum():
    times = time_pieces(prompt_len=64, rounds=1)
    assert list(times) == list(PIECES)
    assert all(times[name] > 0 for name in PIECES)
    assert times["total"] == pytest.approx(sum(times[name] for name in PIECES[:-1]))


def test_the_report_has_a_row_per_tree_and_their_ratio():
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "bench" / "serve" / "intake.py"), "--prompt-len", "64",
                             "--repeats", "1", "--rounds", "1", "--baseline", str(ROOT)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("one 64-id prompt on /v1/completions")
    assert lines[1].split() == list(PIECES)
    assert [line.split()[0] for line in lines[2:]] == ["baseline", "this", "ratio"]


def test_bad_counts_exit_2_naming_the_flags():
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "bench" / "serve" / "intake.py"), "--repeats", "0"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "--repeats and --rounds must be at least 1" in result.stderr
