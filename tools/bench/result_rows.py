"""Rows of benchmark results: each printed as soon as it is measured, appended to a results
file as a JSON line, and printed again as one table at the end."""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Callable, Sequence
from datetime import date
from pathlib import Path

MACHINE = ""  # set once by the benchmark: what every row was measured on


class Rows:
    """Result rows, each appended to the results file and printed as soon as it is measured."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self.rows: list[dict] = []

    def add(self, result: dict) -> None:
        self.rows.append(result)
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps(result) + "\n")
        print_table([result])


def row(name, value, unit, baseline_name="", baseline=None, ratio=None, target=None, note="",
        lower_is_better=False, target_is_value=False) -> dict:
    if target is None:
        met = None
    elif target_is_value or lower_is_better:
        met = value <= target if lower_is_better else value >= target
    else:
        met = ratio is not None and ratio >= target
    return dict(name=name, value=value, unit=unit, baseline_name=baseline_name, baseline=baseline,
                ratio=ratio, target=target, met=met, note=note, command=" ".join(sys.argv),
                machine=MACHINE, date=str(date.today()))


def print_table(rows: list[dict]) -> None:
    def fmt(x):
        return "" if x is None else f"{x:,.3f}" if abs(x) < 10 else f"{x:,.1f}"

    print(f"{'benchmark':42} {'spillway':>12} {'unit':13} {'baseline':>12} {'(what)':20} {'ratio':>7} "
          f"{'target':>8} met")
    for r in rows:
        met = "" if r["met"] is None else "yes" if r["met"] else "NO"
        print(f"{r['name']:42} {fmt(r['value']):>12} {r['unit']:13} {fmt(r['baseline']):>12} "
              f"{r['baseline_name'][:20]:20} {fmt(r['ratio']):>7} {fmt(r['target']):>8} {met}")
        if r["note"]:
            print(f"{'':42}   {r['note']}")
    sys.stdout.flush()


def runs_of_trees(measure: Callable[[Path | None], dict[str, float]], baseline: Path | None,
                  repeats: int) -> dict[str, list[dict[str, float]]]:
    """`repeats` runs of `measure(tree)` for the baseline tree (if any) and this one (None),
    alternating, by label ("baseline", "this tree")."""
    trees = ([("baseline", baseline)] if baseline is not None else []) + [("this tree", None)]
    runs: dict[str, list[dict[str, float]]] = {label: [] for label, _ in trees}
    for _ in range(repeats):
        for label, tree in trees:
            runs[label].append(measure(tree))
    return runs


def print_tree_medians(title: str, runs: dict[str, list[dict[str, float]]], pieces: Sequence[str],
                       width: int) -> None:
    """`title`, then each tree's median of every piece over its runs, and with a baseline the
    ratio of this tree's medians to its."""
    print(title)
    print(f"{'':>10}  " + "  ".join(f"{name:>{width}}" for name in pieces))
    medians = {label: {name: statistics.median(run[name] for run in results) for name in pieces}
               for label, results in runs.items()}
    for label, median in medians.items():
        print(f"{label:>10}  " + "  ".join(f"{median[name]:>{width}.1f}" for name in pieces))
    if "baseline" in medians:
        print(f"{'ratio':>10}  " + "  ".join(f"{medians['this tree'][n] / medians['baseline'][n]:>{width}.2f}"
                                            for n in pieces))
