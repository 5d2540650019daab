"""cascade_attention against its reference, the prefill reference and the prefill kernel:
sequences sharing their first blocks, with own keys and query lengths of their own (1 among
them), GQA groups 1, 2 and 4, head_dim 64, a float8 cache, prefixes shorter than a tile; and
one launch, as a CUDA graph holds it, over prefix lengths read from memory (0 among them),
splits that hold no keys, padding sequences and rows."""

import itertools

import pytest
import torch
from kernel_testing import gpu, paged_kv, random_tensor, relative_error

from spillway.kernels.cascade_attention import cascade_attention, cascade_num_splits, launch
from spillway.kernels.paged_attention_prefill import paged_prefill_attention
from spillway.kernels.ragged_attention_reference import cascade_attention_reference, paged_prefill_attention_reference
from spillway.kernels.utils import multiprocessor_count

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


def staged(prefix_len: int, device) -> torch.Tensor:
    """The prefix length in device memory, as the runner stages it."""
    return torch.tensor([prefix_len], dtype=torch.int32, device=device)


def default_splits(q, cache, prefix_len: int) -> int:
    return cascade_num_splits(q.shape[0], cache.shape[4], q.shape[1] // cache.shape[4], q.shape[2], prefix_len,
                              multiprocessor_count(cache.device))


def _check(prefix_len, own_lens, query_lens, *, num_splits=None, tolerance=1e-5, **shape):
    q, cache, starts, lens, tables = shared_batch(prefix_len, own_lens, query_lens, padded_rows=2, **shape)
    scale = q.shape[2] ** -0.5
    num_rows = sum(query_lens)
    num_splits = num_splits or default_splits(q, cache, prefix_len)
    out = cascade_attention(q, cache, 1, starts, lens, tables, scale, max(query_lens), staged(prefix_len, q.device),
                            num_splits)
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


@pytest.mark.parametrize("num_splits", [1, 3, 8])
def test_any_split_count_gives_the_same_result(num_splits):
    """1,088 keys, 17 tiles of 64: one split; 3 of 6, 6 and 5 tiles; or 8 of at least MIN_SPLIT
    (4 tiles), 5 of them holding keys, the last one tile: each split's partial is merged once."""
    _check(1088, [3, 20, 0], [2, 1, 5], num_heads=6, num_kv_heads=3, head_dim=32, num_splits=num_splits)


GRAPH_SHAPES = [(4, 4, None), (8, 4, None), (8, 2, None), (8, 2, FP8)]


@pytest.mark.parametrize("num_heads,num_kv_heads,cache_dtype", GRAPH_SHAPES, ids=["group1", "group2", "group4", "fp8"])
def test_one_launch_serves_any_prefix_length_in_memory(num_heads, num_kv_heads, cache_dtype):
    """A CUDA graph's launch: the same tensors, 8 splits and a grid sized for 1,088 shared keys,
    two padding sequences (no new tokens, context 0) and padded rows; only the prefix length in
    memory changes, from none to less than a tile, to one not a multiple of the tile (nor of
    a block), to one that fills 5 of the 8 splits. Every answer is the prefill reference's, with
    the other sequences' entries for the prefix's whole tiles pointing at a NaN block: the
    launch read each length from memory, and the prefix through the first table only."""
    query_lens = [3, 1, 6]
    q, cache, starts, lens, tables = shared_batch(1088, [2, 30, 0], query_lens, num_heads=num_heads,
                                                  num_kv_heads=num_kv_heads, head_dim=32, padded_rows=5,
                                                  cache_dtype=cache_dtype)
    num_rows, scale = sum(query_lens), 32**-0.5
    expected = paged_prefill_attention_reference(q, cache, 1, starts, lens, tables, scale)[:num_rows]
    padded_starts = torch.cat([starts, starts[-1:].repeat(2)])
    padded_lens = torch.cat([lens, torch.zeros(2, dtype=torch.int32)])
    padded_tables = torch.cat([tables, torch.zeros(2, tables.shape[1], dtype=torch.int32)])
    unused = min(set(range(cache.shape[0])) - set(tables.flatten().tolist()))
    cache[unused] = float("nan")
    prefix_len = staged(0, q.device)
    for length in (0, 48, 200, 1088):
        prefix_len.fill_(length)
        poisoned = padded_tables.clone()
        poisoned[1:, : length // 64 * 64 // 16] = unused
        out = cascade_attention(q, cache, 1, padded_starts, padded_lens, poisoned, scale, 6, prefix_len, 8)
        assert relative_error(out[:num_rows], expected) < 1e-5, length
        reference = cascade_attention_reference(q, cache, 1, starts, lens, tables, scale, length)
        assert relative_error(out[:num_rows], reference[:num_rows]) < 1e-5, length


@pytest.mark.parametrize("prefix_n,cache_dtype", [(128, None), (128, FP8)], ids=["keys128", "keys128-fp8"])
def test_the_prefix_pass_tile_is_its_own(prefix_n, cache_dtype):
    """The prefix pass on tiles of `prefix_n` keys, the suffix pass on its 64: 1,088 keys make
    8 whole tiles of 128 for the prefix pass (3 splits), and the suffix pass reads from 1,024
    on, with the 64 keys the prefix pass's tiles left out."""
    query_lens = [3, 1, 6]
    q, cache, starts, lens, tables = shared_batch(1088, [2, 30, 0], query_lens, num_heads=8, num_kv_heads=2,
                                                  head_dim=32, cache_dtype=cache_dtype)
    num_rows, scale = sum(query_lens), 32**-0.5
    out = launch(q, cache, 1, starts, lens, tables, scale, 6, staged(1088, q.device), 3, torch.empty_like(q),
                 prefix_n=prefix_n)
    expected = paged_prefill_attention_reference(q, cache, 1, starts, lens, tables, scale)
    assert relative_error(out[:num_rows], expected[:num_rows]) < 1e-5
    with pytest.raises(ValueError, match="the prefix pass's 32-key tiles are not whole 64-key tiles"):
        launch(q, cache, 1, starts, lens, tables, scale, 6, staged(1088, q.device), 3, torch.empty_like(q),
               prefix_n=32)


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
    out = cascade_attention(q, cache, 1, starts, lens, tables, 32**-0.5, 2, staged(256, q.device), 2)
    assert relative_error(out[:3], expected[:3]) < 1e-5


def test_split_count_fills_the_machine_within_bounds():
    # The convoy: 50 sequences x 4 new tokens (200 rows, 7 tiles of 32 tokens) x 8 KV heads on 132 SMs.
    assert cascade_num_splits(200, 8, 4, 128, 10_000, 132) == 4  # 7 row tiles x 8 heads x 4: 1.7 waves
    assert cascade_num_splits(4, 8, 4, 128, 10_000, 132) == 16  # few rows: at most 16
    assert cascade_num_splits(4, 8, 4, 128, 700, 132) == 2  # splits of at least 256 keys
    assert cascade_num_splits(4096, 8, 4, 128, 10_000, 132) == 1


def test_bad_arguments_are_refused():
    q, cache, starts, lens, tables = shared_batch(32, [0, 0], [2, 1], num_heads=4, num_kv_heads=2, head_dim=32)
    prefix_len = staged(32, q.device)
    with pytest.raises(ValueError, match="prefix_len must have 1 dims"):
        cascade_attention(q, cache, 1, starts, lens, tables, 1.0, 2, prefix_len[0], 1)
    with pytest.raises(ValueError, match="prefix_len must be one of \\['torch.int32'\\]"):
        cascade_attention(q, cache, 1, starts, lens, tables, 1.0, 2, prefix_len.long(), 1)
    with pytest.raises(ValueError, match="prefix_len has 2 entries, expected 1"):
        cascade_attention(q, cache, 1, starts, lens, tables, 1.0, 2, prefix_len.repeat(2), 1)
    with pytest.raises(ValueError, match="num_splits must be an int >= 1"):
        cascade_attention(q, cache, 1, starts, lens, tables, 1.0, 2, prefix_len, 0)
    with pytest.raises(ValueError, match="seq_lens has 1 entries, expected 2"):
        cascade_attention(q, cache, 1, starts, lens[:1], tables, 1.0, 2, prefix_len, 1)


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
