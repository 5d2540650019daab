"""paged_prefill_attention against its reference: ragged batches with cached prefixes,
single-token sequences, block boundaries, GQA groups (odd, 1 and MHA), padded rows, a float8
e4m3 cache."""

import itertools

import pytest
import torch
from kernel_testing import gpu, paged_kv, random_tensor, relative_error

from spillway.kernels.paged_attention_prefill import paged_prefill_attention
from spillway.kernels.ragged_attention_reference import paged_prefill_attention_reference


FP8 = torch.float8_e4m3fn


def _check(num_heads, num_kv_heads, head_dim, block_size, query_lens, seq_lens, *, padded_rows=0,
           dtype=torch.float32, cache_dtype=None, device="cpu", tolerance=1e-5, num_splits=1):
    device = torch.device(device)
    cache, tables = paged_kv(seq_lens, block_size=block_size, num_kv_heads=num_kv_heads,
                             head_dim=head_dim, dtype=dtype, cache_dtype=cache_dtype, device=device)
    starts = torch.tensor([0, *itertools.accumulate(query_lens)], dtype=torch.int32, device=device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    num_rows = sum(query_lens)
    q = random_tensor(num_rows + padded_rows, num_heads, head_dim, dtype=dtype, device=device)
    scale = head_dim**-0.5
    out = paged_prefill_attention(q, cache, 1, starts, lens, tables, scale, max(query_lens), num_splits)
    ref = paged_prefill_attention_reference(q, cache, 1, starts, lens, tables, scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert relative_error(out[:num_rows], ref[:num_rows]) < tolerance
    return out


CPU_CASES = [
    # (heads, kv_heads, head_dim, block_size, query_lens, seq_lens)
    (9, 3, 32, 16, [17, 1, 16, 5], [17, 40, 50, 5]),  # fresh, decode, cached prefix, short
    (6, 1, 32, 8, [33, 2, 15], [33, 9, 16]),
    (2, 2, 64, 32, [20, 1], [53, 1]),
    (4, 2, 32, 128, [70, 3, 1], [200, 130, 1]),  # blocks longer than a tile
]


@pytest.mark.parametrize("case", CPU_CASES, ids=lambda case: f"H{case[0]}-{case[1]}-D{case[2]}-bs{case[3]}")
def test_matches_reference(case):
    _check(*case, padded_rows=2)


# float16, not bfloat16: Triton's interpreter does bf16 arithmetic on the raw bits.
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", [CPU_CASES[0], CPU_CASES[3]], ids=["bs16", "bs128"])
def test_float8_cache_matches_reference_and_stays_near_full_precision(dtype, case):
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    out = _check(*case, padded_rows=2, dtype=dtype, cache_dtype=FP8, tolerance=tolerance)
    num_heads, num_kv_heads, head_dim, block_size, query_lens, seq_lens = case
    cache, tables = paged_kv(seq_lens, block_size=block_size, num_kv_heads=num_kv_heads, head_dim=head_dim)
    starts = torch.tensor([0, *itertools.accumulate(query_lens)], dtype=torch.int32)
    q = random_tensor(sum(query_lens) + 2, num_heads, head_dim)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    full_precision = paged_prefill_attention_reference(q, cache, 1, starts, lens, tables, head_dim**-0.5)
    error = relative_error(out[: sum(query_lens)], full_precision[: sum(query_lens)])
    assert 2**-9 < error < 2**-4, f"relative error {error:.4f} against the float32 cache"


def test_cached_prefix_is_attended():
    """With a cached prefix, the new queries see the prefix's keys: changing one changes them."""
    cache, tables = paged_kv([24], block_size=8, num_kv_heads=1, head_dim=16, poison=False)
    starts = torch.tensor([0, 4], dtype=torch.int32)
    lens = torch.tensor([24], dtype=torch.int32)
    q = random_tensor(4, 2, 16)
    before = paged_prefill_attention(q, cache, 0, starts, lens, tables, 0.25, 4)
    cache[int(tables[0, 0]), 0, :, 3] += 1.0
    after = paged_prefill_attention(q, cache, 0, starts, lens, tables, 0.25, 4)
    assert not torch.allclose(after, before)


def test_bad_arguments_are_refused():
    cache, tables = paged_kv([5], block_size=16, num_kv_heads=2, head_dim=32)
    q = torch.zeros(5, 4, 32)
    starts = torch.tensor([0, 5], dtype=torch.int32)
    lens = torch.tensor([5], dtype=torch.int32)
    with pytest.raises(ValueError, match="query_start_loc has 3 entries, expected 2"):
        paged_prefill_attention(q, cache, 0, torch.tensor([0, 5, 5], dtype=torch.int32), lens, tables, 1.0, 5)
    with pytest.raises(ValueError, match="seq_lens must be one of"):
        paged_prefill_attention(q, cache, 0, starts, lens.long(), tables, 1.0, 5)
    with pytest.raises(ValueError, match="q must be one of"):
        paged_prefill_attention(q.half(), cache, 0, starts, lens, tables, 1.0, 5)
    with pytest.raises(ValueError, match="kv_cache must be one of"):
        paged_prefill_attention(q, cache.to(torch.float8_e5m2), 0, starts, lens, tables, 1.0, 5)


GPU_CASES = [
    (32, 8, 128, 16),  # Qwen3-8B
    (16, 8, 128, 16),  # Qwen3-0.6B
    (9, 3, 64, 16),  # SmolLM2-135M
    (32, 32, 128, 32),
    (16, 4, 256, 64),
]


@pytest.mark.parametrize("num_splits", [1, 8])
@pytest.mark.parametrize("cache_dtype", [None, FP8], ids=["bf16-cache", "fp8-cache"])
@pytest.mark.parametrize("case", GPU_CASES, ids=str)
@gpu[0]
@gpu[1]
def test_gpu_bf16(case, cache_dtype, num_splits):
    query_lens = [512, 1, 300, 77, 1, 16, 129, 32]
    seq_lens = [512, 1500, 1000, 77, 17, 33, 2000, 4128]
    _check(*case, query_lens, seq_lens, padded_rows=3, dtype=torch.bfloat16, cache_dtype=cache_dtype,
           device="cuda", tolerance=1e-2, num_splits=num_splits)


SPLIT_CASES = [
    # (heads, kv_heads, head_dim, block_size, query_lens, seq_lens): new tokens after long prefixes,
    # a fresh prompt, a decode, a sequence shorter than one split.
    (4, 2, 32, 16, [5, 17, 1, 3], [700, 300, 1000, 3]),
    (9, 3, 32, 8, [33, 2], [600, 290]),
]


@pytest.mark.parametrize("num_splits", [2, 4])
@pytest.mark.parametrize("case", SPLIT_CASES, ids=["gqa2", "gqa3"])
def test_split_keys_match_the_reference(case, num_splits):
    """Splits of at least 64 keys here (MIN_SPLIT_LEN lowered), so short contexts split too;
    every row's splits are combined, none counted twice (a wrong count fails it)."""
    from spillway.kernels import paged_attention_prefill as module

    num_heads, num_kv_heads, head_dim, block_size, query_lens, seq_lens = case
    cache, tables = paged_kv(seq_lens, block_size=block_size, num_kv_heads=num_kv_heads, head_dim=head_dim)
    starts = torch.tensor([0, *itertools.accumulate(query_lens)], dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    num_rows = sum(query_lens)
    q = random_tensor(num_rows + 3, num_heads, head_dim)
    ref = paged_prefill_attention_reference(q, cache, 1, starts, lens, tables, head_dim**-0.5)
    out = torch.empty_like(q)
    module.launch(q, cache, 1, starts, lens, tables, head_dim**-0.5, max(query_lens), out,
                  num_splits=num_splits, min_split_len=64)
    assert relative_error(out[:num_rows], ref[:num_rows]) < 1e-5
    assert bool((out[num_rows:] == 0).all())  # the padded rows: no split counted, zeros
    # Through the public call (splits of at least MIN_SPLIT keys): the same result.
    public = paged_prefill_attention(q, cache, 1, starts, lens, tables, head_dim**-0.5, max(query_lens),
                                     num_splits=num_splits)
    assert relative_error(public[:num_rows], ref[:num_rows]) < 1e-5


def test_split_count_follows_the_tiles_of_one_sequence_and_the_grid_cap():
    from spillway.kernels.paged_attention_prefill import prefill_num_splits

    # Qwen3-8B heads (32 over 8 KV heads, 16 query tokens a tile), 132 multiprocessors.
    assert prefill_num_splits(32, 32, 8, 4, 128, 132) == 8  # 2 tiles x 8 heads; 512 x 8 programs
    assert prefill_num_splits(16, 16, 8, 4, 128, 132) == 16
    assert prefill_num_splits(64, 32, 8, 4, 128, 132) == 4
    assert prefill_num_splits(128, 32, 8, 4, 128, 132) == 2
    assert prefill_num_splits(512, 32, 8, 4, 128, 132) == 1
    assert prefill_num_splits(4096, 1, 8, 4, 128, 132) == 1  # 256 tiles x 8 heads fill the machine
    with pytest.raises(ValueError, match="num_splits must be a power of two"):
        cache, tables = paged_kv([5], block_size=16, num_kv_heads=2, head_dim=32)
        paged_prefill_attention(torch.zeros(5, 4, 32), cache, 0, torch.tensor([0, 5], dtype=torch.int32),
                                torch.tensor([5], dtype=torch.int32), tables, 1.0, 5, num_splits=3)
