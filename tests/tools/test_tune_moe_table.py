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


def test_round_one_keeps_large_prefill_tiles_at_two_stages():
    from spillway.tools.bench.kernels.moe_cases import MoeShape
    from spillway.tools.bench.kernels.tune_moe import deepest_stages, round_one

    assert deepest_stages(64, 64, 64, 2) == 3
    assert deepest_stages(128, 128, 128, 2) == 2  # 3 stages of its gate, up and row tiles: 288 KiB
    assert deepest_stages(128, 256, 128, 2) is None
    found = {(c.block_size_m, c.block_size_n, c.block_size_k): c.num_stages
             for c in round_one(4096, MoeShape("q", 128, 2048, 768, 8), 2) if c.path == "grouped"}
    assert found[(128, 128, 128)] == 2 and found[(128, 128, 64)] == 3
