"""tools/bench/kernels/buckets.py: the products it times and the buckets it compares."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from spillway.worker.runner.cuda_graphs import PREFILL_TOKEN_BUCKETS

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))

from spillway.tools.bench.kernels import buckets  # noqa: E402


def test_one_qwen3_8b_layer_has_its_four_products():
    # qkv: 32 query heads and 8 KV heads of 128; gate and up fused; down.
    assert buckets.layer_shapes("qwen3-8b") == [(4096, 6144), (4096, 4096), (4096, 24576), (12288, 4096)]


def test_a_step_takes_the_smallest_bucket_that_holds_it_and_none_past_the_last():
    old = (16, 32, 64, 96, 128, 192, 256, 384, 512)
    assert [buckets.bucket_of(n, old) for n in (1, 16, 17, 200, 257, 512)] == [16, 16, 32, 256, 384, 512]
    assert buckets.bucket_of(513, old) is None
    assert buckets.bucket_of(200, PREFILL_TOKEN_BUCKETS) == 208


def test_bad_step_sizes_are_refused_and_no_gpu_is_said_plainly(monkeypatch, capsys):
    with pytest.raises(SystemExit):
        buckets.main(["--tokens", "200,0"])
    assert "positive step sizes" in capsys.readouterr().err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="none is visible"):
        buckets.main(["--tokens", "200"])


def test_a_weight_stored_either_way_gives_the_same_products():
    torch.manual_seed(0)
    input_major = buckets.product_weight(8, 6, True, device="cpu", dtype=torch.float32)
    output_major = buckets.product_weight(8, 6, False, device="cpu", dtype=torch.float32)
    assert input_major.shape == output_major.shape == (6, 8)
    assert input_major.stride() == (1, 6) and output_major.stride() == (8, 1)
    x = torch.randn(3, 8)
    same = input_major.contiguous()
    torch.testing.assert_close(torch.nn.functional.linear(x, input_major), torch.nn.functional.linear(x, same))


def test_layouts_without_a_gpu_is_said_plainly(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="none is visible"):
        buckets.main(["--layouts", "--tokens", "1,208"])
