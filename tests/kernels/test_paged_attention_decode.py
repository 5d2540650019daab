"""paged_decode_attention against its reference: GQA groups, Q = 1 and Q = 4, block
boundaries, zero-length padding rows, several splits, strided q, a float8 e4m3 cache; a CUDA
graph replay on GPU."""

import pytest
import torch
from kernel_testing import gpu, paged_kv, random_tensor, relative_error

from spillway.kernels.paged_attention_decode import (
    default_num_splits,
    launch,
    paged_decode_attention,
    paged_decode_attention_reference,
)

CPU_CASES = [
    # (heads, kv_heads, head_dim, block_size, query_len, context_lens, num_splits)
    (9, 3, 32, 16, 1, [15, 16, 17, 33, 0, 1], 1),
    (9, 3, 32, 16, 1, [17, 33, 0], 3),
    (6, 1, 64, 8, 4, [4, 17, 33, 0], 1),
    (6, 1, 64, 8, 4, [4, 17, 33, 0], 2),
    (2, 2, 16, 32, 2, [2, 32, 65], 4),
    (8, 2, 32, 16, 1, [100, 3], None),
    (4, 2, 32, 128, 1, [150, 7, 0, 129], 2),  # blocks longer than a tile; a split with no tokens
    (9, 3, 32, 16, 3, [5, 130, 0, 200], 8),  # most splits of the short contexts hold no tokens
]


FP8 = torch.float8_e4m3fn


def _check(num_heads, num_kv_heads, head_dim, block_size, query_len, context_lens, num_splits, *,
           dtype=torch.float32, cache_dtype=None, device="cpu", tolerance=1e-5, layer=1):
    device = torch.device(device)
    cache, tables = paged_kv(context_lens, block_size=block_size, num_kv_heads=num_kv_heads,
                             head_dim=head_dim, dtype=dtype, cache_dtype=cache_dtype, device=device)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=device)
    q = random_tensor(len(context_lens), query_len, num_heads, head_dim, dtype=dtype, device=device)
    scale = head_dim**-0.5
    out = paged_decode_attention(q, cache, layer, tables, lens, scale, num_splits)
    ref = paged_decode_attention_reference(q, cache, layer, tables, lens, scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert relative_error(out, ref) < tolerance
    padded = [i for i, n in enumerate(context_lens) if n == 0]
    assert torch.equal(out[padded], torch.zeros_like(out[padded]))
    return out


@pytest.mark.parametrize("case", CPU_CASES, ids=lambda case: f"H{case[0]}-{case[1]}-D{case[2]}-bs{case[3]}-Q{case[4]}-s{case[6]}")
def test_matches_reference(case):
    _check(*case)


# float16, not bfloat16: Triton's interpreter does bf16 arithmetic on the raw bits.
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", [CPU_CASES[0], CPU_CASES[3], CPU_CASES[6], CPU_CASES[7]],
                         ids=["Q1-s1", "Q4-s2", "bs128-s2", "Q3-s8"])
def test_float8_cache_matches_reference_and_stays_near_full_precision(case, dtype):
    out = _check(*case, dtype=dtype, cache_dtype=FP8, tolerance=1e-5 if dtype == torch.float32 else 1e-2)
    num_heads, num_kv_heads, head_dim, block_size, query_len, context_lens, _ = case
    cache, tables = paged_kv(context_lens, block_size=block_size, num_kv_heads=num_kv_heads, head_dim=head_dim)
    q = random_tensor(len(context_lens), query_len, num_heads, head_dim)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    full_precision = paged_decode_attention_reference(q, cache, 1, tables, lens, head_dim**-0.5)
    error = relative_error(out, full_precision)
    assert 2**-9 < error < 2**-4, f"relative error {error:.4f} against the float32 cache"


@pytest.mark.parametrize("cache_dtype", [torch.float32, FP8], ids=["fp32-cache", "fp8-cache"])
@pytest.mark.parametrize("one_loop", [False, True], ids=["two-loops", "one-loop"])
def test_either_loop_structure_matches_reference(one_loop, cache_dtype):
    """Two loops (the default) or one masked loop (a tuning option): the same results over
    either cache."""
    context_lens = [5, 130, 0, 200, 64]
    cache, tables = paged_kv(context_lens, block_size=16, num_kv_heads=3, head_dim=32, cache_dtype=cache_dtype)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    q = random_tensor(len(context_lens), 3, 9, 32)
    out = launch(q, cache, 1, tables, lens, 0.2, 2, block_n=32, one_loop=one_loop)
    ref = paged_decode_attention_reference(q, cache, 1, tables, lens, 0.2)
    assert relative_error(out, ref) < 1e-5


def test_three_dim_q_and_strided_q():
    cache, tables = paged_kv([20, 9], block_size=16, num_kv_heads=3, head_dim=32)
    lens = torch.tensor([20, 9], dtype=torch.int32)
    fused = random_tensor(2, (9 + 6) * 32)
    q = fused[:, : 9 * 32].view(2, 9, 32)  # row stride 15 * 32, as a slice of a fused qkv
    out = paged_decode_attention(q, cache, 0, tables, lens, 0.2, num_splits=2)
    ref = paged_decode_attention_reference(q.contiguous(), cache, 0, tables, lens, 0.2)
    assert out.shape == (2, 9, 32)
    assert relative_error(out, ref) < 1e-5


def test_queries_attend_causally_among_themselves():
    """Changing the last position's K/V must not change the earlier queries' outputs."""
    cache, tables = paged_kv([19], block_size=8, num_kv_heads=1, head_dim=16, poison=False)
    lens = torch.tensor([19], dtype=torch.int32)
    q = random_tensor(1, 3, 2, 16)
    before = paged_decode_attention(q, cache, 1, tables, lens, 0.25, num_splits=1)
    last_block, last_offset = int(tables[0, 18 // 8]), 18 % 8
    cache[last_block, 1, :, last_offset] += 1.0
    after = paged_decode_attention(q, cache, 1, tables, lens, 0.25, num_splits=1)
    assert torch.equal(after[:, :2], before[:, :2])
    assert not torch.allclose(after[:, 2], before[:, 2])


def test_default_num_splits_depends_on_static_sizes_only():
    cpu = torch.device("cpu")  # counts as 8 multiprocessors
    assert default_num_splits(1, 8, 4096, cpu) == 4
    assert default_num_splits(1, 8, 100, cpu) == 1
    assert default_num_splits(2, 1, 40000, cpu) == 16
    assert default_num_splits(512, 8, 4096, cpu) == 1


def test_bad_arguments_are_refused():
    cache, tables = paged_kv([5], block_size=16, num_kv_heads=2, head_dim=32)
    lens = torch.tensor([5], dtype=torch.int32)
    q = torch.zeros(1, 4, 32)
    with pytest.raises(ValueError, match="block_tables must be one of"):
        paged_decode_attention(q, cache, 0, tables.long(), lens, 1.0)
    with pytest.raises(ValueError, match="not a multiple of 2 KV heads"):
        paged_decode_attention(torch.zeros(1, 3, 32), cache, 0, tables, lens, 1.0)
    with pytest.raises(ValueError, match="context_lens has 2 entries"):
        paged_decode_attention(q, cache, 0, tables, torch.tensor([5, 5], dtype=torch.int32), 1.0)
    with pytest.raises(ValueError, match="q must be one of"):
        paged_decode_attention(q.bfloat16(), cache, 0, tables, lens, 1.0)
    with pytest.raises(ValueError, match="kv_cache must be one of"):
        paged_decode_attention(q, cache.to(torch.float8_e5m2), 0, tables, lens, 1.0)
    with pytest.raises(ValueError, match="head_dim must be a power of two"):
        odd_cache, _ = paged_kv([5], block_size=16, num_kv_heads=2, head_dim=24)
        paged_decode_attention(torch.zeros(1, 4, 24), odd_cache, 0, tables, lens, 1.0)


GPU_CASES = [
    # Qwen3-8B / Llama-3-8B heads, SmolLM2-135M heads; Q = 1 and speculative Q = 4.
    (32, 8, 128, 16, 1, None),
    (32, 8, 128, 16, 4, None),
    (32, 8, 128, 16, 1, 7),
    (9, 3, 64, 16, 1, None),
    (16, 8, 128, 64, 4, 3),
    (16, 2, 256, 128, 1, None),
]


@pytest.mark.parametrize("cache_dtype", [None, FP8], ids=["bf16-cache", "fp8-cache"])
@pytest.mark.parametrize("case", GPU_CASES, ids=str)
@gpu[0]
@gpu[1]
def test_gpu_bf16(case, cache_dtype):
    num_heads, num_kv_heads, head_dim, block_size, query_len, num_splits = case
    generator = torch.Generator().manual_seed(sum(case[:5]))
    lens = torch.randint(query_len, 3000, (37,), generator=generator)
    lens[[3, 20]] = 0
    lens[5] = block_size
    lens[6] = block_size + 1
    _check(num_heads, num_kv_heads, head_dim, block_size, query_len, lens.tolist(), num_splits,
           dtype=torch.bfloat16, cache_dtype=cache_dtype, device="cuda", tolerance=1e-2)


@gpu[0]
@gpu[1]
def test_gpu_cuda_graph_replay_with_new_lengths():
    """Capture once with short contexts, replay with long ones (and padding rows)."""
    device = torch.device("cuda")
    lens_before, lens_after = [5, 17, 0, 33], [900, 1, 0, 2047]
    cache, tables = paged_kv([2048] * 4, block_size=16, num_kv_heads=8, head_dim=128,
                             dtype=torch.bfloat16, device=device, poison=False)
    q = random_tensor(4, 32, 128, dtype=torch.bfloat16, device=device)
    lens = torch.tensor(lens_before, dtype=torch.int32, device=device)
    paged_decode_attention(q, cache, 0, tables, lens, 0.088)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_decode_attention(q, cache, 0, tables, lens, 0.088)
    for new_lens in (lens_before, lens_after):
        lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        graph.replay()
        ref = paged_decode_attention_reference(q, cache, 0, tables, lens, 0.088)
        assert relative_error(out, ref) < 1e-2
        assert torch.equal(out[2], torch.zeros_like(out[2]))
