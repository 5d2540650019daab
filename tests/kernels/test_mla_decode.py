"""paged_mla_decode against its reference: heads in one and in several row blocks, Q = 1 and
speculative Q = 3, block boundaries, zero-length padding rows, several splits, strided q, a
float8 e4m3 cache; DeepSeek's shapes and a CUDA graph replay on GPU."""

import pytest
import torch
from kernel_testing import gpu, paged_kv, random_tensor, relative_error

from spillway.kernels.mla_decode import (
    LaunchSettings,
    default_num_splits,
    launch,
    paged_mla_decode,
    paged_mla_decode_reference,
)

FP8 = torch.float8_e4m3fn


def latent_cache(context_lens, *, block_size, row_dim, dtype=torch.float32, cache_dtype=None, device="cpu",
                 poison=True, seed=0):
    """A latent cache `[num_blocks, 2 layers, 1, block_size, 1, row_dim]` and int32 block tables
    giving each sequence its own shuffled blocks: the key side of kernel_testing's paged cache,
    NaN (or, in a float8 cache, 256 past a context in its last block) outside every context."""
    cache, tables = paged_kv(context_lens, block_size=block_size, num_kv_heads=1, head_dim=row_dim, dtype=dtype,
                             cache_dtype=cache_dtype, poison=poison, seed=seed)
    return cache[:, :, :1].contiguous().to(device), tables.to(device)


CPU_CASES = [
    # (heads, kv_lora_rank, rope_dim, block_size, query_len, context_lens, num_splits)
    (4, 32, 16, 16, 1, [15, 16, 17, 0, 1, 50], 1),
    (4, 32, 16, 16, 1, [15, 16, 17, 0, 1, 50], 3),
    (16, 64, 16, 16, 1, [40, 0, 70], 2),
    (40, 32, 16, 8, 1, [33, 0, 9], 4),  # two row blocks of 32, the second a quarter full
    # Speculative, Q = 3: 15 rows in one block of 16; 36 rows in two blocks of 32, the heads of
    # query 2 in both. The positions some queries must not see end a whole tile (32, 17) or
    # straddle two (33).
    (5, 32, 16, 16, 3, [5, 32, 0, 2, 17, 33], 1),
    (12, 32, 16, 8, 3, [5, 32, 0, 2, 17, 33], 2),
    (4, 32, 32, 32, 1, [100, 3, 0], None),  # blocks longer than a tile
]


def _check(num_heads, kv_lora_rank, rope_dim, block_size, query_len, context_lens, num_splits, *,
           dtype=torch.float32, cache_dtype=None, device="cpu", tolerance=1e-5, layer=1):
    row_dim = kv_lora_rank + rope_dim
    cache, tables = latent_cache(context_lens, block_size=block_size, row_dim=row_dim, dtype=dtype,
                                 cache_dtype=cache_dtype, device=device)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=device)
    shape = (num_heads, row_dim) if query_len == 1 else (query_len, num_heads, row_dim)
    q = random_tensor(len(context_lens), *shape, dtype=dtype, device=device)
    args = (q, cache, layer, tables, lens)
    kwargs = dict(kv_lora_rank=kv_lora_rank, scale=row_dim**-0.5, num_splits=num_splits)
    out = paged_mla_decode(*args, **kwargs)
    ref = paged_mla_decode_reference(*args, **kwargs)
    assert out.shape == (*q.shape[:-1], kv_lora_rank) and out.dtype == q.dtype
    error = relative_error(out, ref)
    assert error < tolerance, f"relative error {error:.2e}"
    padded = [i for i, n in enumerate(context_lens) if n == 0]
    assert torch.equal(out[padded], torch.zeros_like(out[padded]))
    return out


def _case_id(case):
    return f"H{case[0]}-r{case[1]}+{case[2]}-bs{case[3]}-Q{case[4]}-s{case[6]}"


@pytest.mark.parametrize("case", CPU_CASES, ids=_case_id)
def test_matches_reference(case):
    _check(*case)


# float16 for the loose 16-bit check: Triton's interpreter does bfloat16 arithmetic on the raw
# bits, so a bfloat16 cache is checked on the GPU only. A bfloat16 q over a float8 cache runs
# its dots in float16 (kernels/fp8.py), which the interpreter does right.
@pytest.mark.parametrize("dtype, cache_dtype, tolerance", [
    (torch.float16, None, 2e-3),
    (torch.float32, FP8, 1e-5),
    (torch.float16, FP8, 2e-3),
    (torch.bfloat16, FP8, 1e-2),
], ids=["fp16", "fp32-fp8-cache", "fp16-fp8-cache", "bf16-fp8-cache"])
@pytest.mark.parametrize("case", [CPU_CASES[1], CPU_CASES[5]], ids=_case_id)
def test_other_dtypes_match_reference(case, dtype, cache_dtype, tolerance):
    _check(*case, dtype=dtype, cache_dtype=cache_dtype, tolerance=tolerance)


@pytest.mark.parametrize("settings", [LaunchSettings(16, 16, 4, 2), LaunchSettings(32, 32, 8, 3),
                                      LaunchSettings(64, 16, 8, 4)], ids=str)
def test_other_launch_settings_match_reference(settings):
    """Rows and tokens a program, warps and stages (tuning options) leave the results alone:
    here 18 rows a request, in blocks of 16, 32 or 64."""
    context_lens = [5, 32, 0, 33, 50]
    cache, tables = latent_cache(context_lens, block_size=16, row_dim=48)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    q = random_tensor(len(context_lens), 3, 6, 48)
    out = launch(q, cache, 1, tables, lens, 32, 0.2, 2, settings)
    ref = paged_mla_decode_reference(q, cache, 1, tables, lens, kv_lora_rank=32, scale=0.2)
    assert relative_error(out, ref) < 1e-5


def test_float8_cache_stays_near_full_precision():
    """The float8 cache's output is its reference's exactly (above), and near the output over
    the float32 rows it was rounded from: neither equal (the cache is read as float8) nor far."""
    num_heads, kv_lora_rank, rope_dim, block_size, _, context_lens, num_splits = CPU_CASES[1]
    row_dim = kv_lora_rank + rope_dim
    q = random_tensor(len(context_lens), num_heads, row_dim)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    outs = []
    for cache_dtype in (FP8, torch.float32):
        cache, tables = latent_cache(context_lens, block_size=block_size, row_dim=row_dim, cache_dtype=cache_dtype)
        outs.append(paged_mla_decode(q, cache, 1, tables, lens, kv_lora_rank=kv_lora_rank, scale=row_dim**-0.5,
                                     num_splits=num_splits))
    error = relative_error(*outs)
    assert 2**-9 < error < 2**-4, f"relative error {error:.4f} against the float32 cache"


def test_strided_q_and_int64_block_tables():
    """q as a slice of a wider tensor (row stride past D), a block table of int64 as the
    runner's metadata holds it."""
    context_lens = [20, 9]
    cache, tables = latent_cache(context_lens, block_size=16, row_dim=48)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    wide = random_tensor(2, 6, 64)
    q = wide[:, :, :48]
    kwargs = dict(kv_lora_rank=32, scale=0.2, num_splits=2)
    out = paged_mla_decode(q, cache, 0, tables.long(), lens, **kwargs)
    ref = paged_mla_decode_reference(q.contiguous(), cache, 0, tables, lens, **kwargs)
    assert out.shape == (2, 6, 32) and out.is_contiguous()
    assert relative_error(out, ref) < 1e-5


def test_queries_attend_causally_among_themselves():
    """Changing the last position's row must not change the earlier queries' outputs."""
    cache, tables = latent_cache([19], block_size=8, row_dim=48, poison=False)
    lens = torch.tensor([19], dtype=torch.int32)
    q = random_tensor(1, 3, 2, 48)
    kwargs = dict(kv_lora_rank=32, scale=0.25, num_splits=1)
    before = paged_mla_decode(q, cache, 1, tables, lens, **kwargs)
    cache[int(tables[0, 18 // 8]), 1, 0, 18 % 8] += 1.0
    after = paged_mla_decode(q, cache, 1, tables, lens, **kwargs)
    assert torch.equal(after[:, :2], before[:, :2])
    assert not torch.allclose(after[:, 2], before[:, 2])


def test_default_num_splits_depends_on_static_sizes_only():
    cpu = torch.device("cpu")  # counts as 8 multiprocessors
    bf16_row = 576 * 2
    # 64 x 16 heads: 64 programs fill 8 multiprocessors, 1 split.
    assert default_num_splits(64, 16, 4096, 512, bf16_row, cpu) == 1
    # 1 x 16 heads: four programs a multiprocessor, 32 splits, as long as each split reads >= 8x
    # its partials (456 bf16 rows, 911 float8 rows at 16 heads; 8 times as many at 128 heads,
    # which take 4 programs of 32 rows a split).
    assert default_num_splits(1, 16, 32768, 512, bf16_row, cpu) == 32
    assert default_num_splits(1, 16, 4096, 512, bf16_row, cpu) == 8
    assert default_num_splits(1, 16, 4096, 512, 576, cpu) == 4
    assert default_num_splits(1, 128, 4096, 512, bf16_row, cpu) == 1
    assert default_num_splits(1, 128, 32768, 512, bf16_row, cpu) == 8
    assert default_num_splits(1, 128, 32768, 512, bf16_row, cpu, block_m=16) == 4
    assert default_num_splits(2, 4, 40, 32, 48 * 4, cpu) == 1


def test_bad_arguments_are_refused():
    cache, tables = latent_cache([5], block_size=16, row_dim=48)
    lens = torch.tensor([5], dtype=torch.int32)
    q = torch.zeros(1, 4, 48)

    def call(q=q, cache=cache, tables=tables, lens=lens, layer=0, kv_lora_rank=32, scale=1.0, num_splits=None):
        return paged_mla_decode(q, cache, layer, tables, lens, kv_lora_rank=kv_lora_rank, scale=scale,
                                num_splits=num_splits)

    cases = [
        (dict(q=q.half()), "q must be one of"),
        (dict(q=torch.zeros(1, 4, 40)), "q's last dim is 40, the cache's rows 48"),
        (dict(q=torch.zeros(4, 48)), "q must have 3 or 4 dims"),
        (dict(cache=cache.expand(-1, -1, 2, -1, -1, -1).contiguous()), "kv_cache must be a latent cache"),
        (dict(cache=cache.to(torch.float8_e5m2)), "kv_cache must be one of"),
        (dict(cache=cache.transpose(0, 1)), "kv_cache must be contiguous"),
        (dict(layer=2), "layer 2 out of range for 2 layers"),
        (dict(kv_lora_rank=24), "kv_lora_rank must be a power of two >= 16, got 24"),
        (dict(kv_lora_rank=64), "must be longer than kv_lora_rank 64"),
        (dict(tables=tables.float()), "block_tables must be one of"),
        (dict(tables=tables.repeat(2, 1)), "block_tables has 2 rows for 1 requests"),
        (dict(lens=lens.long()), "context_lens must be one of"),
        (dict(lens=torch.tensor([5, 5], dtype=torch.int32)), "context_lens has 2 entries for 1 requests"),
        (dict(scale=0.0), "scale must be a positive finite number"),
        (dict(num_splits=0), "num_splits must be None or a positive int"),
    ]
    for overrides, message in cases:
        with pytest.raises(ValueError, match=message):
            call(**overrides)
    odd_rope, odd_tables = latent_cache([5], block_size=16, row_dim=56)
    with pytest.raises(ValueError, match="the rope part, 56 - 32 = 24 values, must be a power of two >= 16"):
        call(q=torch.zeros(1, 4, 56), cache=odd_rope, tables=odd_tables)
    odd_blocks, odd_tables = latent_cache([5], block_size=12, row_dim=48)
    with pytest.raises(ValueError, match="block_size must be a power of two, got 12"):
        call(cache=odd_blocks, tables=odd_tables)


# DeepSeek V2/V3: kv_lora_rank 512, rope 64; 16 heads (V2-Lite, or 128 over 8 GPUs) and 128.
GPU_CASES = [
    # (heads, block_size, query_len, num_splits)
    (16, 16, 1, None),
    (16, 64, 1, 3),
    (128, 16, 1, None),
    (128, 64, 1, 2),
    (16, 16, 2, None),
]


@pytest.mark.parametrize("cache_dtype", [None, FP8], ids=["bf16-cache", "fp8-cache"])
@pytest.mark.parametrize("case", GPU_CASES, ids=str)
@gpu[0]
@gpu[1]
def test_gpu_deepseek_shapes(case, cache_dtype):
    num_heads, block_size, query_len, num_splits = case
    generator = torch.Generator().manual_seed(sum(case[:3]))
    lens = torch.randint(query_len, 2500, (19,), generator=generator)
    lens[[3, 11]] = 0
    lens[5] = block_size
    lens[6] = block_size + 1
    _check(num_heads, 512, 64, block_size, query_len, lens.tolist(), num_splits, dtype=torch.bfloat16,
           cache_dtype=cache_dtype, device="cuda", tolerance=1e-2)


@pytest.mark.parametrize("num_heads", [16, 128])
@gpu[0]
@gpu[1]
def test_gpu_cuda_graph_replay_with_new_lengths(num_heads):
    """Capture once with short contexts, replay with long ones (and padding rows): the graph's
    output equals the eager launch's."""
    device = torch.device("cuda")
    lens_before, lens_after = [5, 17, 0, 33], [900, 1, 0, 2047]
    cache, tables = latent_cache([2048] * 4, block_size=16, row_dim=576, dtype=torch.bfloat16, device=device,
                                 poison=False)
    q = random_tensor(4, num_heads, 576, dtype=torch.bfloat16, device=device)
    lens = torch.tensor(lens_before, dtype=torch.int32, device=device)
    kwargs = dict(kv_lora_rank=512, scale=192**-0.5)
    paged_mla_decode(q, cache, 0, tables, lens, **kwargs)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_mla_decode(q, cache, 0, tables, lens, **kwargs)
    for new_lens in (lens_before, lens_after):
        lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        graph.replay()
        eager = paged_mla_decode(q, cache, 0, tables, lens, **kwargs)
        assert torch.equal(out, eager)
        ref = paged_mla_decode_reference(q, cache, 0, tables, lens, **kwargs)
        assert relative_error(out, ref) < 1e-2
        assert torch.equal(out[2], torch.zeros_like(out[2]))
