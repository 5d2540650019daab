"""tools/bench/kernels/tune_moe.py keeps the batch sizes a table already holds for its shape."""

import json

import pytest

from spillway.tools.bench.kernels.tune_moe import earlier_buckets

SHAPE = dict(experts=4, hidden=48, intermediate=40, topk=2, dtype="fp32", device="cpu")


def write(path, shape, buckets):
    path.write_text(json.dumps({"shape": shape, "tuned_with": {}, "buckets": buckets}))


def test_same_shape_keeps_its_buckets(tmp_path):
    path = tmp_path / "table.json"
    write(path, SHAPE, {"1": {"path": "pairs"}, "64": {"path": "grouped"}})
    assert earlier_buckets(path, SHAPE) == {"1": {"path": "pairs"}, "64": {"path": "grouped"}}


def test_other_shape_or_no_file_starts_empty(tmp_path):
    path = tmp_path / "table.json"
    assert earlier_buckets(path, SHAPE) == {}
    assert earlier_buckets(None, SHAPE) == {}
    write(path, dict(SHAPE, experts=8), {"1": {"path": "pairs"}})
    assert earlier_buckets(path, SHAPE) == {}


def test_a_file_that_is_not_a_table_is_a_clear_error(tmp_path):
    path = tmp_path / "table.json"
    path.write_text("not json")
    with pytest.raises(SystemExit, match="is not a table"):
        earlier_buckets(path, SHAPE)
