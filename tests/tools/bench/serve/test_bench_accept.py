"""tools/bench/serve/accept.py runs both kinds of servers and prints every row."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))

from spillway.tools.bench.serve import accept  # noqa: E402


def test_every_row_is_printed_for_both_kinds_of_servers(capsys):
    assert accept.main(["--servers", "2", "--connections", "6", "--gaps-ms", "0,1", "--rounds", "1"]) == 0
    header, *rows = capsys.readouterr().out.splitlines()
    assert header.startswith("2 API servers, 6 connections, 1 rounds")
    for name in ("pool, 0 ms apart", "pool, 1 ms apart", "plain burst"):
        kinds = [row.split(name, 1)[1].split()[:2] for row in rows if row.strip().startswith(name)]
        assert sorted(kinds) == [["counts", "median" if name == "plain burst" else "taken"], ["no", "counts"]]
    for row in rows:
        if "taken per server" in row:  # every connection answered, by one of the two servers
            taken = json.loads(row.split("taken per server ", 1)[1])
            assert sum(taken) == 6 and len(taken) <= 2
