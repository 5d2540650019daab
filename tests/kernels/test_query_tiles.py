"""The attention kernels' grid over a ragged batch's query tiles (kernels/attention_tile.py):
the bound covers every tile for any query lengths, and the prefill and cascade kernels agree
with their references on a batch laid out as a CUDA graph holds it: empty sequence slots
between and after the real ones, padded rows, the bucket as the longest query."""

import itertools
import random

import pytest
import torch
from kernel_testing import paged_kv, random_tensor, relative_error
from test_cascade_attention import shared_batch, staged

from spillway.kernels.attention_tile import query_tile_grid
from spillway.kernels.cascade_attention import cascade_attention
from spillway.kernels.paged_attention_prefill import paged_prefill_attention
from spillway.kernels.ragged_attention_reference import cascade_attention_reference, paged_prefill_attention_reference


def test_the_grid_covers_every_query_tile():
    rng = random.Random(0)
    for _ in range(2000):
        block_q = rng.choice([1, 2, 4, 8, 16, 32])
        query_lens = [rng.choice([0, 0, 1, 2, 3, 4, 5, 17, 64, 200]) for _ in range(rng.randint(1, 70))]
        padded_rows = rng.randint(0, 40)
        grid, flat = query_tile_grid(sum(query_lens) + padded_rows, len(query_lens), max(query_lens), block_q, 3)
        tiles = [-(-n // block_q) for n in query_lens]
        if flat:
            assert sum(tiles) <= grid[0] and grid[1] == 3
        else:
            assert grid == (max(1, max(tiles)), len(query_lens), 3)
    # The convoy's prefill graph: 200 rows of 50 sequences in a 208-row bucket of 64 slots.
    assert query_tile_grid(208, 64, 208, 4, 8) == ((100, 8), True)  # against 52 x 64 = 3,328 per KV head
    assert query_tile_grid(208, 64, 208, 16, 8) == ((73, 8), True)  # against 13 x 64 = 832
    assert query_tile_grid(16, 16, 16, 16, 8) == ((1, 16, 8), False)  # 16 rows and slots: no gain
    assert query_tile_grid(20, 3, 17, 16, 8) == ((2, 3, 8), False)  # eager: its own longest query


def graph_layout(query_lens, seq_lens, tables):
    """Empty slots (query length 0, context 0) spliced in as a graph's padding does it: query_start_loc
    repeats its value there, their table rows are 0."""
    empty = [1, 3]  # slot indices of empty sequences among the real ones, plus two at the end
    slots = list(query_lens)
    lens = list(seq_lens)
    rows = list(range(len(query_lens)))
    for index in empty:
        slots.insert(index, 0)
        lens.insert(index, 0)
        rows.insert(index, None)
    slots += [0, 0]
    lens += [0, 0]
    rows += [None, None]
    padded = torch.zeros(len(rows), tables.shape[1], dtype=torch.int32)
    for slot, row in enumerate(rows):
        if row is not None:
            padded[slot] = tables[row]
    starts = torch.tensor([0, *itertools.accumulate(slots)], dtype=torch.int32)
    return starts, torch.tensor(lens, dtype=torch.int32), padded


# (tiles of 4 or 16 tokens, padded rows, whether the grid is flat): 27 rows in 6 slots.
GRID_CASES = [(16, 7, True), (64, 7, False), (64, 200, True)]


@pytest.mark.parametrize("rows,padded_rows,flat", GRID_CASES)
def test_prefill_kernel_on_a_graph_layout(rows, padded_rows, flat):
    from spillway.kernels.paged_attention_prefill import launch

    query_lens, seq_lens = [5, 1, 17, 4], [9, 30, 17, 40]
    cache, tables = paged_kv(seq_lens, block_size=16, num_kv_heads=2, head_dim=32)
    num_rows = sum(query_lens)
    q = random_tensor(num_rows + padded_rows, 8, 32)
    starts, lens, padded = graph_layout(query_lens, seq_lens, tables)
    assert query_tile_grid(q.shape[0], 6, q.shape[0], rows // 4, 2)[1] == flat
    expected = paged_prefill_attention_reference(q, cache, 1, starts, lens, padded, 32**-0.5)
    for num_splits in (1, 2):
        out = torch.empty_like(q)
        launch(q, cache, 1, starts, lens, padded, 32**-0.5, q.shape[0], out, num_splits, rows=rows)
        assert relative_error(out[:num_rows], expected[:num_rows]) < 1e-5
    default = paged_prefill_attention(q, cache, 1, starts, lens, padded, 32**-0.5, q.shape[0])
    assert relative_error(default[:num_rows], expected[:num_rows]) < 1e-5


@pytest.mark.parametrize("rows,padded_rows,flat", [(16, 40, True), (64, 0, False), (64, 180, True)])
def test_cascade_suffix_on_a_graph_layout(rows, padded_rows, flat):
    from spillway.kernels.cascade_attention import launch

    prefix_len, own_lens, query_lens = 256, [0, 3, 17, 1], [4, 1, 6, 4]
    q, cache, starts, lens, tables = shared_batch(prefix_len, own_lens, query_lens, num_heads=8, num_kv_heads=2,
                                                  head_dim=32, padded_rows=padded_rows)
    assert query_tile_grid(q.shape[0], 6, q.shape[0], rows // 4, 2)[1] == flat
    num_rows = sum(query_lens)
    expected = cascade_attention_reference(q, cache, 1, starts, lens, tables, 32**-0.5, prefix_len)
    starts, lens, padded = graph_layout(query_lens, lens.tolist(), tables)  # sequence 0 stays in slot 0
    out = torch.empty_like(q)
    launch(q, cache, 1, starts, lens, padded, 32**-0.5, q.shape[0], staged(prefix_len, q.device), 2, out, rows=rows)
    assert relative_error(out[:num_rows], expected[:num_rows]) < 1e-5
    default = cascade_attention(q, cache, 1, starts, lens, padded, 32**-0.5, q.shape[0], staged(prefix_len, q.device), 2)
    assert relative_error(default[:num_rows], expected[:num_rows]) < 1e-5
