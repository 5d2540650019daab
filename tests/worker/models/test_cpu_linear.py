"""The oneDNN-packed CPU linear layers agree with `F.linear` and replace the model's linears."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from spillway.worker.models.cpu_linear import PackedLinear, onednn_linear_works, pack_linear_layers

@pytest.mark.parametrize("rows", [1, 3, 16, 17, 129])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_functional_linear(rows, bias):
    torch.manual_seed(rows)
    linear = nn.Linear(200, 333, bias=bias)
    x = torch.randn(rows, 200)
    expected = F.linear(x, linear.weight, linear.bias)
    with torch.no_grad():
        got = PackedLinear(linear)(x)
    assert got.shape == (rows, 333)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_packed_linear_takes_leading_batch_dims():
    torch.manual_seed(0)
    linear = nn.Linear(64, 48)
    x = torch.randn(2, 5, 64)
    with torch.no_grad():
        torch.testing.assert_close(PackedLinear(linear)(x), linear(x), rtol=1e-5, atol=1e-5)


def test_bfloat16_is_packed_where_onednn_has_it_and_left_dense_elsewhere():
    # oneDNN's bf16 linear needs avx512bw/vl/dq or avx_ne_convert: some CPU machines lack both.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 48, dtype=torch.bfloat16), nn.Linear(48, 16, dtype=torch.bfloat16))
    x = torch.randn(7, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        expected = model(x).float()
        packed = pack_linear_layers(model)
        got = model(x).float()
    if onednn_linear_works(torch.bfloat16):
        assert packed == 2 and all(type(m) is PackedLinear for m in model)
    else:
        assert packed == 0 and all(type(m) is nn.Linear for m in model)
    torch.testing.assert_close(got, expected, rtol=0.02, atol=0.05)


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.block = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
        self.head = nn.Linear(16, 50, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(self.block(self.embed(ids)))


def test_pack_linear_layers_replaces_every_linear_and_keeps_a_tied_embedding():
    torch.manual_seed(0)
    model = _Tied().eval()
    ids = torch.tensor([1, 7, 49, 3])
    with torch.no_grad():
        expected = model(ids)
        assert pack_linear_layers(model) == 3
        got = model(ids)
    assert [type(m) for m in (model.block[0], model.block[2], model.head)] == [PackedLinear] * 3
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert model.embed.weight.shape == (50, 16)  # the lookup table stays dense
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_pack_linear_layers_leaves_unsupported_dtypes_alone():
    model = nn.Sequential(nn.Linear(8, 8, dtype=torch.float64))
    assert not onednn_linear_works(torch.float64)
    assert pack_linear_layers(model) == 0
    assert type(model[0]) is nn.Linear


def test_row_counts_are_padded_to_a_bounded_set_of_sizes():
    from spillway.worker.models.cpu_linear import EXACT_ROWS, padded_rows

    sizes = {padded_rows(rows) for rows in range(1, 8193)}
    assert len(sizes) <= 100  # oneDNN keeps memory per shape: few shapes, bounded memory
    assert all(padded_rows(rows) == rows for rows in range(1, EXACT_ROWS + 1))
    assert all(rows <= padded_rows(rows) <= rows * 1.125 for rows in range(1, 8193))


@pytest.mark.parametrize("rows", [33, 100, 1000])
def test_padded_products_give_the_rows_asked_for(rows):
    torch.manual_seed(rows)
    linear = nn.Linear(64, 40)
    x = torch.randn(rows, 64)
    with torch.no_grad():
        got = PackedLinear(linear)(x)
    assert got.shape == (rows, 40)
    torch.testing.assert_close(got, F.linear(x, linear.weight, linear.bias), rtol=1e-5, atol=1e-5)
