"""paged_mla_prefill against its reference and against paged_mla_decode: a ragged batch of a
fresh prompt, an extend after a cached prefix of several shuffled blocks, a decode row and a
padding sequence; one head block of several tokens and several head blocks of one token; a
graph-sized batch (padding sequences, padded rows); float16 and float8 caches; DeepSeek's shapes
and a CUDA graph replayed with new lengths on GPU."""

import itertools

import pytest
import torch
from kernel_testing import gpu, random_tensor, relative_error
from test_mla_decode import latent_cache

from spillway.kernels.mla_decode import LaunchSettings, paged_mla_decode
from spillway.kernels.mla_prefill import launch, paged_mla_prefill, paged_mla_prefill_reference, tile_shape

FP8 = torch.float8_e4m3fn


def ragged_batch(query_lens, seq_lens, *, num_heads, kv_lora_rank, rope_dim=16, block_size=16, padded_rows=2,
                 dtype=torch.float32, cache_dtype=None, device="cpu", poison=True):
    """(args, kwargs) of a call: q `[sum(query_lens) + padded_rows, heads, D]`, a latent cache
    (NaN outside every context) with shuffled block tables, int32 query_start_loc and seq_lens."""
    row_dim = kv_lora_rank + rope_dim
    cache, tables = latent_cache(seq_lens, block_size=block_size, row_dim=row_dim, dtype=dtype,
                                 cache_dtype=cache_dtype, device=device, poison=poison)
    starts = torch.tensor([0, *itertools.accumulate(query_lens)], dtype=torch.int32, device=device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    q = random_tensor(sum(query_lens) + padded_rows, num_heads, row_dim, dtype=dtype, device=device)
    kwargs = dict(kv_lora_rank=kv_lora_rank, scale=row_dim**-0.5, max_query_len=max(query_lens))
    return (q, cache, 1, starts, lens, tables), kwargs


def _check(query_lens, seq_lens, *, tolerance=1e-5, **batch):
    args, kwargs = ragged_batch(query_lens, seq_lens, **batch)
    out = paged_mla_prefill(*args, **kwargs)
    ref = paged_mla_prefill_reference(*args, **kwargs)
    q, num_rows = args[0], sum(query_lens)
    assert out.shape == (*q.shape[:2], kwargs["kv_lora_rank"]) and out.dtype == q.dtype
    error = relative_error(out[:num_rows], ref[:num_rows])
    assert error < tolerance, f"relative error {error:.2e}"
    return out


# A fresh prompt of 21; 13 new tokens after a prefix of 57 (four blocks of 16, the last part
# full); a decode of one token after 29; a padding sequence.
MIXED = ([21, 13, 1, 0], [21, 70, 30, 0])

CPU_CASES = [
    # (heads, kv_lora_rank, block_size): tiles of 8 tokens x 4 heads; 6 x 5 of 32 rows (2 spare);
    # one token x 8 heads (16 rows, 8 spare: max_query_len x heads picks 16 rows only for
    # decode); blocks of 8, smaller than a tile.
    (4, 32, 16),
    (5, 64, 16),
    (2, 32, 8),
]


@pytest.mark.parametrize("case", CPU_CASES, ids=lambda case: f"H{case[0]}-r{case[1]}-bs{case[2]}")
def test_ragged_batch_matches_reference(case):
    num_heads, kv_lora_rank, block_size = case
    _check(*MIXED, num_heads=num_heads, kv_lora_rank=kv_lora_rank, block_size=block_size)


def test_deepseek_rows_of_512_and_64():
    """The released models' split of a row, 16 heads in one program of a token each."""
    _check(*MIXED, num_heads=16, kv_lora_rank=512, rope_dim=64)


def test_graph_sized_batch_with_padding_sequences():
    """A graph bucket: 64 rows for a longest query of 64, eight sequence slots of which two hold
    tokens. The grid runs over the rows' tiles (the flat search), not slots x 8 tiles."""
    query_lens, seq_lens = [5, 1, 0, 0, 0, 0, 0, 0], [40, 17, 0, 0, 0, 0, 0, 0]
    args, kwargs = ragged_batch(query_lens, seq_lens, num_heads=4, kv_lora_rank=32, padded_rows=58)
    kwargs["max_query_len"] = 64
    out = paged_mla_prefill(*args, **kwargs)
    ref = paged_mla_prefill_reference(*args, **kwargs)
    assert relative_error(out[:6], ref[:6]) < 1e-5


@pytest.mark.parametrize("settings", [LaunchSettings(16, 16, 4, 2), LaunchSettings(16, 32, 4, 3),
                                      LaunchSettings(64, 16, 8, 3)], ids=str)
def test_other_launch_settings_match_reference(settings):
    """Rows and tokens a program (tuning options) leave the results alone: with 20 heads, two
    head blocks of 16 (the second a quarter full), or 3 tokens x 20 heads in 64 rows."""
    args, kwargs = ragged_batch(*MIXED, num_heads=20, kv_lora_rank=32)
    out = launch(*args, kwargs["kv_lora_rank"], kwargs["scale"], kwargs["max_query_len"], settings)
    ref = paged_mla_prefill_reference(*args, **kwargs)
    assert relative_error(out[:35], ref[:35]) < 1e-5


def test_tile_shape():
    assert tile_shape(4, 32) == (8, 4, 1)
    assert tile_shape(5, 32) == (6, 5, 1)
    assert tile_shape(16, 16) == (1, 16, 1)
    assert tile_shape(128, 32) == (1, 32, 4)
    assert tile_shape(20, 16) == (1, 16, 2)


# float16, not bfloat16, for the 16-bit cache: Triton's interpreter does bfloat16 arithmetic on
# the raw bits. A bfloat16 q over a float8 cache runs its dots in float16 (kernels/fp8.py).
@pytest.mark.parametrize("dtype, cache_dtype, tolerance", [
    (torch.float16, None, 2e-3),
    (torch.float32, FP8, 1e-5),
    (torch.float16, FP8, 2e-3),
    (torch.bfloat16, FP8, 1e-2),
], ids=["fp16", "fp32-fp8-cache", "fp16-fp8-cache", "bf16-fp8-cache"])
def test_other_dtypes_match_reference(dtype, cache_dtype, tolerance):
    _check(*MIXED, num_heads=4, kv_lora_rank=32, dtype=dtype, cache_dtype=cache_dtype, tolerance=tolerance)


@pytest.mark.parametrize("query_len", [1, 3])
def test_equals_decode_kernel_for_equal_query_lengths(query_len):
    """Sequences of Q queries each are what paged_mla_decode takes: both kernels agree (to
    rounding: their tiles sum in different orders), block boundaries and a context of Q included."""
    seq_lens = [query_len, 16, 17, 33, 50]
    query_lens = [query_len] * len(seq_lens)
    args, kwargs = ragged_batch(query_lens, seq_lens, num_heads=6, kv_lora_rank=32, padded_rows=0)
    q, cache, layer, _, lens, tables = args
    out = paged_mla_prefill(*args, **kwargs)
    decode = paged_mla_decode(q.view(len(seq_lens), query_len, 6, 48), cache, layer, tables, lens,
                              kv_lora_rank=32, scale=kwargs["scale"], num_splits=1)
    assert relative_error(out, decode.view(out.shape)) < 1e-6


def test_queries_attend_causally_and_see_the_prefix():
    """Changing the row of position 20 (a new token, the 5th of 8 after a prefix of 16) leaves
    the outputs of the queries before it exactly alone and changes the others; changing a
    prefix row changes every query's."""
    args, kwargs = ragged_batch([8], [24], num_heads=3, kv_lora_rank=32, block_size=8, padded_rows=0,
                                poison=False)
    cache, tables = args[1], args[5]
    before = paged_mla_prefill(*args, **kwargs)
    cache[int(tables[0, 20 // 8]), 1, 0, 20 % 8] += 1.0
    after = paged_mla_prefill(*args, **kwargs)
    assert torch.equal(after[:4], before[:4])
    assert all(not torch.allclose(after[token], before[token]) for token in range(4, 8))
    cache[int(tables[0, 0]), 1, 0, 3] += 1.0
    prefix_changed = paged_mla_prefill(*args, **kwargs)
    assert all(not torch.allclose(prefix_changed[token], after[token]) for token in range(8))


def test_strided_q_and_int64_block_tables():
    args, kwargs = ragged_batch([3, 1], [20, 9], num_heads=4, kv_lora_rank=32, padded_rows=0)
    q, cache, layer, starts, lens, tables = args
    wide = random_tensor(4, 4, 64)
    wide[..., :48] = q
    out = paged_mla_prefill(wide[..., :48], cache, layer, starts, lens, tables.long(), **kwargs)
    assert out.is_contiguous()
    assert relative_error(out, paged_mla_prefill_reference(*args, **kwargs)) < 1e-5


def test_empty_batch_returns_at_once():
    args, kwargs = ragged_batch([0, 0], [0, 0], num_heads=4, kv_lora_rank=32, padded_rows=3)
    assert paged_mla_prefill(*args, **kwargs).shape == (3, 4, 32)


def test_bad_arguments_are_refused():
    (q, cache, _, starts, lens, tables), _ = ragged_batch([5], [5], num_heads=4, kv_lora_rank=32, padded_rows=0)

    def call(q=q, cache=cache, layer=0, starts=starts, lens=lens, tables=tables, kv_lora_rank=32, scale=1.0,
             max_query_len=5):
        return paged_mla_prefill(q, cache, layer, starts, lens, tables, kv_lora_rank=kv_lora_rank, scale=scale,
                                 max_query_len=max_query_len)

    cases = [
        (dict(q=q[None]), r"q must be a tensor \[tokens, heads, D\], got shape \(1, 5, 4, 48\)"),
        (dict(q=q.half()), "q must be one of"),
        (dict(q=torch.zeros(5, 4, 40)), "q's last dim is 40, the cache's rows 48"),
        (dict(cache=cache.expand(-1, -1, 2, -1, -1, -1).contiguous()), "kv_cache must be a latent cache"),
        (dict(cache=cache.to(torch.float8_e5m2)), "kv_cache must be one of"),
        (dict(layer=2), "layer 2 out of range for 2 layers"),
        (dict(kv_lora_rank=24), "kv_lora_rank must be a power of two >= 16, got 24"),
        (dict(tables=tables.float()), "block_tables must be one of"),
        (dict(starts=torch.tensor([0, 5, 5], dtype=torch.int32)),
         "query_start_loc has 3 entries for 1 sequences, expected 2"),
        (dict(starts=starts.long()), "query_start_loc must be one of"),
        (dict(lens=torch.tensor([5, 5], dtype=torch.int32)), "seq_lens has 2 entries for 1 sequences, expected 1"),
        (dict(lens=lens.float()), "seq_lens must be one of"),
        (dict(scale=float("inf")), "scale must be a positive finite number"),
        (dict(max_query_len=torch.tensor(5)), "max_query_len must be an int >= 0"),
        (dict(max_query_len=-1), "max_query_len must be an int >= 0, got -1"),
    ]
    for overrides, message in cases:
        with pytest.raises(ValueError, match=message):
            call(**overrides)


# DeepSeek V2/V3: kv_lora_rank 512, rope 64; 16 heads (V2-Lite, or 128 over 8 GPUs) and 128.
GPU_QUERY_LENS = [1000, 1, 300, 77, 0, 16, 129, 1]
GPU_SEQ_LENS = [1000, 1500, 1000, 77, 0, 33, 2000, 4128]


@pytest.mark.parametrize("cache_dtype", [None, FP8], ids=["bf16-cache", "fp8-cache"])
@pytest.mark.parametrize("num_heads, block_size", [(16, 16), (16, 64), (128, 16)], ids=str)
@gpu[0]
@gpu[1]
def test_gpu_deepseek_shapes(num_heads, block_size, cache_dtype):
    _check(GPU_QUERY_LENS, GPU_SEQ_LENS, num_heads=num_heads, kv_lora_rank=512, rope_dim=64, block_size=block_size,
           padded_rows=3, dtype=torch.bfloat16, cache_dtype=cache_dtype, device="cuda", tolerance=1e-2)


@pytest.mark.parametrize("cache_dtype", [None, FP8], ids=["bf16-cache", "fp8-cache"])
@pytest.mark.parametrize("num_heads", [16, 128])
@gpu[0]
@gpu[1]
def test_gpu_cuda_graph_replay_with_new_lengths(num_heads, cache_dtype):
    """Capture once for 256 rows and 4 sequence slots, replay with other lengths (a long extend,
    a decode, padding sequences, padded rows): the graph's output equals the eager launch's."""
    device = torch.device("cuda")
    num_rows = 256
    cache, tables = latent_cache([2048] * 4, block_size=16, row_dim=576, dtype=torch.bfloat16,
                                 cache_dtype=cache_dtype, device=device, poison=False)
    q = random_tensor(num_rows, num_heads, 576, dtype=torch.bfloat16, device=device)
    starts = torch.zeros(5, dtype=torch.int32, device=device)
    lens = torch.zeros(4, dtype=torch.int32, device=device)
    kwargs = dict(kv_lora_rank=512, scale=192**-0.5, max_query_len=num_rows)
    batches = [([200, 1, 50, 0], [200, 700, 2048, 0]), ([1, 0, 0, 0], [1, 0, 0, 0]),
               ([10, 246, 0, 0], [1500, 246, 0, 0])]

    def stage(query_lens, seq_lens):
        starts.copy_(torch.tensor([0, *itertools.accumulate(query_lens)], dtype=torch.int32))
        lens.copy_(torch.tensor(seq_lens, dtype=torch.int32))

    stage(*batches[0])
    paged_mla_prefill(q, cache, 0, starts, lens, tables, **kwargs)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_mla_prefill(q, cache, 0, starts, lens, tables, **kwargs)
    for query_lens, seq_lens in batches:
        stage(query_lens, seq_lens)
        graph.replay()
        rows = sum(query_lens)
        eager = paged_mla_prefill(q, cache, 0, starts, lens, tables, **kwargs)
        assert torch.equal(out[:rows], eager[:rows])
        ref = paged_mla_prefill_reference(q, cache, 0, starts, lens, tables, **kwargs)
        assert relative_error(out[:rows], ref[:rows]) < 1e-2
