"""tools/bench/tier/overlap.py on the CPU, small: every case and mode is timed and reported (the
loads land as they are queued here, so the rows only check the tool)."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(ROOT))

from spillway.tools.bench.tier import overlap  # noqa: E402


def test_a_run_reports_the_load_and_both_steps_of_each_case(capsys):
    overlap.main(["--model", "smollm2-135m", "--convoy", "3x2@64", "--repeats", "1", "--warm-up", "0"])
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.split()[:1] in (["convoy"], ["lone"])}
    assert set(rows) == {"convoy", "lone"}
    for values in rows.values():
        load, whole, after, by_layer, ratio, *host = (float(value.rstrip(",")) for value in values)
        assert 0 < load <= after and 0 < whole <= after and by_layer > 0 and abs(ratio - after / by_layer) < 0.01
        assert len(host) == 4 and all(value >= 0 for value in host)
