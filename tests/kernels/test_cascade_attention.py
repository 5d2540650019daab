"""cascade_attention against its reference, the prefill reference and the prefill kernel:
sequences sharing their first blocks, with own keys and query lengths of their own (1 among
them), GQA groups 1, 2 and 4, head_dim 64, a float8 cache, prefixes shorter than a tile."""

import itertools

import pytest
import torch
from kernel_testing import gpu, paged_kv, random_tensor, relative_error

from spillway.kernels.cascade_attention import cascade_attention, cascade_attention_reference, cascade_num_splits
from spillway.kernels.paged_attention_prefill import paged_prefill_attention, paged_prefill_attention_reference

FP8 = torch.float8_e4m3fn


def shared_batch(prefix_len, own_lens, query_lens, *, num_heads, num_kv_heads, head_dim, block_size=16,
                 padded_rows=0, dtype=torch.float32, cache_dtype=None, device="cpu"):
    """Sequences whose first `prefix_len // block_size` table entries are sequence 0's; sequence b
    then has `own_lens[b]` cached keys of its own and `query_lens[b]` new ones. Returns
    (q, cache, query_start_loc, seq_lens, tables)."""
    device = torch.device(device)
    lens = [prefix_len + own + new for own, new in zip(own_lens, query_lens)]
    cache, tables = paged_kv(lens, block_size=block_size, num_kv_heads=num_kv_heads, head_dim=head_dim,
                             dtype=dtype, cache_dtype=cache_dtype)
    tables[1:, : prefix_len // block_size] = tables[0, : prefix_len // block_size]
    starts = torch.tensor([0, *itertools.accumulate(query_lens)], dtype=torch.int32, device=device)
    q = random_tensor(sum(query_lens) + padded_rows, num_heads, head_dim, dtype=dtype, device=device)
    return q, cache.to(device), starts, torch.tensor(lens, dtype=torch.int32, device=device), tables.to(device)


def _check(prefix_len, own_lens, query_lens, *, num_splits=None, tolerance=1e-5, **shape):
    q, cache, starts, lens, tables = shared_batch(prefix_len, own_lens, query_lens, padded_rows=2, **shape)
    scale = q.shape[2] ** -0.5
    num_rows = sum(query_lens)
    out = cascade_attention(q, cache, 1, starts, lens, tables, scale, max(query_lens), prefix_len, num_splits)
    assert out.shape == q.shape and out.dtype == q.dtype
    for expected in (cascade_attention_reference(q, cache, 1, starts, lens, tables, scale, prefix_len),
                     paged_prefill_attention_reference(q, cache, 1, starts, lens, tables, scale),
                     paged_prefill_attention(q, cache, 1, starts, lens, tables, scale, max(query_lens))):
        assert relative_error(out[:num_rows], expected[:num_rows]) < tolerance
    return out


CASES = [
    # (prefix_len, own_lens, query_lens, heads, kv_heads, head_dim, block_size)
    (256, [0, 40, 3, 17], [4, 1, 9, 2], 4, 4, 32, 16),  # group 1; no own keys; 2 splits by default
    (160, [5, 0, 70], [1, 3, 1], 8, 4, 32, 16),  # group 2; prefix ends mid-tile
    (192, [9, 33], [17, 1], 8, 2, 64, 32),  # group 4, head_dim 64, more new tokens than a tile holds
]


@pytest.mark.parametrize("case", CASES, ids=["group1", "group2", "group4-d64"])
def test_matches_the_references_and_the_prefill_kernel(case):
    prefix_len, own_lens, query_lens, heads, kv_heads, head_dim, block_size = case
    _check(prefix_len, own_lens, query_lens, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
           block_size=block_size)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_any_split_count_gives_the_same_result(num_splits):
    """Splits of 2 tiles and 1 (the last shorter): every split's partial is merged once."""
    _check(320, [3, 20, 0], [2, 1, 5], num_heads=6, num_kv_heads=3, head_dim=32, num_splits=num_splits)


def test_a_prefix_shorter_than_a_tile_is_read_with_each_sequence():
    """A prefix of 48 keys rounds down to no whole tile: the suffix pass alone reads it all."""
    _check(48, [4, 0], [3, 1], num_heads=4, num_kv_heads=2, head_dim=32)


# float16, not bfloat16: Triton's interpreter does bf16 arithmetic on the raw bits.
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_float8_cache(dtype):
    _check(160, [5, 0, 21], [1, 3, 2], num_heads=8, num_kv_heads=2, head_dim=32, dtype=dtype, cache_dtype=FP8,
           tolerance=1e-5 if dtype == torch.float32 else 1e-2)


def test_the_prefix_is_read_through_the_first_table_only():
    """The other sequences' prefix entries point at a NaN-filled block: the result does not
    change, so the prefix pass read the prefix once, through sequence 0's table."""
    q, cache, starts, lens, tables = shared_batch(256, [7, 2], [2, 1], num_heads=4, num_kv_heads=2, head_dim=32)
    expected = paged_prefill_attention_reference(q, cache, 1, starts, lens, tables, 32**-0.5)
    unused = min(set(range(cache.shape[0])) - set(tables.flatten().tolist()))
    cache[unused] = float("nan")
    tables[1:, :4] = unused  # the prefix pass covers keys 0..255, blocks 0..15; poison a few
    out = cascade_attention(q, cache, 1, starts, lens, tables, 32**-0.5, 2, 256)
    assert relative_error(out[:3], expected[:3]) < 1e-5


def test_split_count_fills_the_machine_within_bounds():
    # The convoy: 50 sequences x 4 new tokens (200 rows, 13 tiles of 16) x 8 KV heads on 132 SMs.
    assert cascade_num_splits(200, 8, 4, 128, 10_000, 132) == 3
    assert cascade_num_splits(4, 8, 4, 128, 10_000, 132) == 16  # few rows: at most 16
    assert cascade_num_splits(4, 8, 4, 128, 700, 132) == 2  # splits of at least 256 keys
    assert cascade_num_splits(4096, 8, 4, 128, 10_000, 132) == 1


def test_bad_arguments_are_refused():
    q, cache, starts, lens, tables = shared_batch(32, [0, 0], [2, 1], num_heads=4, num_kv_heads=2, head_dim=32)
    with pytest.raises(ValueError, match="prefix_len must be an int in 0..64"):
        cascade_attention(q, cache, 1, starts, lens, tables, 1.0, 2, 65)
    with pytest.raises(ValueError, match="num_splits must be None or an int >= 1"):
        cascade_attention(q, cache, 1, starts, lens, tables, 1.0, 2, 32, 0)
    with pytest.raises(ValueError, match="seq_lens has 1 entries, expected 2"):
        cascade_attention(q, cache, 1, starts, lens[:1], tables, 1.0, 2, 32)


@pytest.mark.parametrize("cache_dtype", [None, FP8], ids=["bf16-cache", "fp8-cache"])
@pytest.mark.parametrize("shape", [(32, 8, 128, 16), (9, 3, 64, 16), (16, 4, 256, 64)], ids=str)
@gpu[0]
@gpu[1]
def test_gpu_bf16(shape, cache_dtype):
    num_heads, num_kv_heads, head_dim, block_size = shape
    own_lens = [0, 3, 500, 17, 64, 1, 1000, 40]
    query_lens = [4, 1, 4, 300, 4, 16, 1, 4]
    _check(4096, own_lens, query_lens, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
           block_size=block_size, dtype=torch.bfloat16, cache_dtype=cache_dtype, device="cuda", tolerance=1e-2)
