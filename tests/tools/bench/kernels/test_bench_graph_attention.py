"""tools/bench/kernels/graph_attention.py's batches and launches, small, through Triton's interpreter:
graph-shaped batches (empty slots, padded rows) give the prefill reference's rows through
both kernels; a baseline tree is imported as spillway from its own path."""

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(ROOT))

from spillway.tools.bench.kernels.graph_attention import check, graph_batch, launcher, tree_pythonpath  # noqa: E402

SMALL = dict(layers=2, heads=(4, 2, 32), dtype=torch.float32, device="cpu")


@pytest.mark.parametrize("suffix_rows", [None, 16])
def test_cascade_case_matches_the_reference(suffix_rows):
    batch = graph_batch(64, [0, 3, 17], [2, 1, 4], 5, 12, **SMALL)
    assert batch["tables"].shape[0] == 5 and batch["q"].shape[0] == 12 and batch["rows"] == 7
    assert bool((batch["tables"][:3, :4] == batch["tables"][0, :4]).all())  # the shared prefix's blocks
    assert check(launcher("cascade", batch, suffix_rows), batch) < 1e-5


def test_prefill_case_matches_the_reference():
    batch = graph_batch(0, [40], [3], 4, 8, **SMALL)
    assert batch["starts"].tolist() == [0, 3, 3, 3, 3] and batch["lens"].tolist() == [43, 0, 0, 0]
    assert check(launcher("prefill", batch), batch) < 1e-5


def test_a_wrong_launch_is_caught():
    batch = graph_batch(0, [40], [3], 4, 8, **SMALL)
    good = launcher("prefill", batch)
    assert check(lambda layer: good(0 if layer == 1 else 1), batch) > 1e-2  # another layer's keys


def test_baseline_tree_is_imported_from_its_path(tmp_path):
    tree = tmp_path / "tree"
    tree.mkdir()
    site = Path(tree_pythonpath(tree).split(":")[0])
    assert (site / "spillway").resolve() == tree.resolve()
