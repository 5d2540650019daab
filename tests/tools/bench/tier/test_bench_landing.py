"""tools/bench/tier/landing.py on the CPU, small: the convoy's chunks share the prefix's blocks and
own theirs after it, a bad shape is a usage error, and a run through a child process reports
both steps of each tree (the smallest built-in model, a 2 x 2 convoy on a 32-token prefix)."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(ROOT))

from spillway.tools.bench.tier import landing  # noqa: E402
from spillway.tools.bench.tier.landing import landing_chunks  # noqa: E402


def test_a_bad_shape_is_a_usage_error(capsys):
    for bad in ("50x4", "1x4@160", "4x4@100"):
        with pytest.raises(SystemExit) as exit_info:
            landing.main(["--convoy", bad])
        assert exit_info.value.code == 2
    assert "SEQSxNEW@PREFIX" in capsys.readouterr().err


def test_chunks_share_the_prefix_blocks_and_own_the_rest():
    chunks = landing_chunks(3, 20, 64, vocab=100)
    assert [c.start for c in chunks] == [64, 64, 64]
    assert all(len(c.token_ids) == 20 and max(c.token_ids) < 100 for c in chunks)
    assert [c.slot_table for c in chunks] == [[0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 6, 7], [0, 1, 2, 3, 8, 9]]


def test_a_run_reports_both_steps_of_each_tree(capsys):
    landing.main(["--model", "smollm2-135m", "--convoy", "2x2@32", "--steps", "1", "--repeats", "1",
                        "--baseline", str(ROOT)])
    out = capsys.readouterr().out
    rows = {}
    for line in out.splitlines():
        for name in ("baseline", "this tree"):
            if line.strip().startswith(name + " "):
                rows[name] = [float(x) for x in line.strip()[len(name):].split()[:3]]
    assert set(rows) == {"baseline", "this tree"}
    for convoy, lone, difference in rows.values():
        assert convoy > 0 and lone > 0 and difference == pytest.approx(convoy - lone, abs=0.011)
    assert "convoy step, baseline / this tree:" in out
