"""TritonAttentionBackend against TorchAttentionBackend: the same step through both, the same
cache afterwards, the same outputs; mixed, decode-only and speculative batches; the
tensors-only DecodeMetadata with padding rows, as a CUDA-graph step uses it."""

import pytest
import torch
from kernel_testing import gpu, random_tensor, relative_error

from spillway.worker.attention import TorchAttentionBackend
from spillway.worker.attention_triton import DecodeMetadata, TritonAttentionBackend


def _step(query_lens, starts, *, num_heads, num_kv_heads, head_dim, block_size=16, padded_rows=0,
          dtype=torch.float32, device="cpu", seed=0):
    """A batch: block tables (int64, 0-padded), slots (-1 for padded rows), q/k/v and a cache."""
    device = torch.device(device)
    generator = torch.Generator().manual_seed(seed)
    context_lens = [start + n for start, n in zip(starts, query_lens)]
    needed = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(needed) + 2
    order = torch.randperm(num_blocks, generator=generator).tolist()
    tables = torch.zeros(len(query_lens), max(needed), dtype=torch.int64)
    slots = []
    for seq, (start, n, count) in enumerate(zip(starts, query_lens, needed)):
        tables[seq, :count] = torch.tensor(order[:count])
        order = order[count:]
        for pos in range(start, start + n):
            slots.append(int(tables[seq, pos // block_size]) * block_size + pos % block_size)
    slots += [-1] * padded_rows
    rows = len(slots)
    cache = random_tensor(num_blocks, 2, 2, block_size, num_kv_heads, head_dim, dtype=dtype, device=device, seed=seed)
    q = random_tensor(rows, num_heads, head_dim, dtype=dtype, device=device, seed=seed + 1)
    k = random_tensor(rows, num_kv_heads, head_dim, dtype=dtype, device=device, seed=seed + 2)
    v = random_tensor(rows, num_kv_heads, head_dim, dtype=dtype, device=device, seed=seed + 3)
    return tables.to(device), torch.tensor(slots, dtype=torch.int64, device=device), cache, q, k, v


def _compare(query_lens, starts, *, tolerance=1e-5, max_decode_query_len=1, **shape):
    tables, slots, cache, q, k, v = _step(query_lens, starts, **shape)
    num_rows = sum(query_lens)
    results = []
    block_size = shape.get("block_size", 16)
    for backend in (TorchAttentionBackend(block_size), TritonAttentionBackend(block_size, None, max_decode_query_len)):
        layer_cache = cache.clone()
        metadata = backend.build_metadata(query_lens, starts, tables, slots)
        out = backend.forward(1, q, k, v, layer_cache, metadata)
        results.append((out, layer_cache, metadata))
    (expected, expected_cache, _), (out, out_cache, metadata) = results
    assert torch.equal(out_cache, expected_cache)
    assert relative_error(out[:num_rows], expected[:num_rows]) < tolerance
    assert not out[num_rows:].any(), "padded rows must be zero"
    return metadata


def test_mixed_batch_uses_the_prefill_kernel():
    metadata = _compare([5, 1, 17, 1], [0, 33, 16, 15], num_heads=9, num_kv_heads=3, head_dim=32, padded_rows=2)
    assert metadata.prefill is not None and metadata.decode is None


def test_decode_batch_uses_the_decode_kernel():
    metadata = _compare([1, 1, 1], [15, 0, 32], num_heads=6, num_kv_heads=1, head_dim=32, padded_rows=1)
    assert metadata.decode is not None and metadata.decode.query_len == 1


def test_speculative_batch_uses_the_decode_kernel():
    metadata = _compare([4, 4], [13, 30], num_heads=4, num_kv_heads=2, head_dim=32, block_size=8,
                        max_decode_query_len=8)
    assert metadata.decode is not None and metadata.decode.query_len == 4


def test_same_length_extends_take_the_prefill_kernel_where_nothing_verifies():
    """The decode kernel compiles a variant per query length: without verification, a burst of
    4-token extends must not meet one mid-serving."""
    metadata = _compare([4, 4], [13, 30], num_heads=4, num_kv_heads=2, head_dim=32, block_size=8)
    assert metadata.decode is None and metadata.prefill is not None


def test_runners_verify_with_the_decode_kernel_only_when_speculating():
    from spillway.worker.model_runner import MAX_VERIFY_QUERY_LEN, default_backend

    cuda = torch.device("cuda")
    assert default_backend(cuda, 16).max_decode_query_len == 1
    assert default_backend(cuda, 16, verifies=True).max_decode_query_len == MAX_VERIFY_QUERY_LEN


def test_decode_metadata_with_padding_sequences():
    """B = 3 sequences, the last one padding (context 0, slot -1), as a graph bucket holds it."""
    backend = TritonAttentionBackend(16)
    tables, slots, cache, q, k, v = _step([1, 1], [20, 3], num_heads=4, num_kv_heads=2, head_dim=32, padded_rows=1)
    reference = TorchAttentionBackend(16)
    expected_cache = cache.clone()
    expected = reference.forward(0, q, k, v, expected_cache, reference.build_metadata([1, 1], [20, 3], tables, slots))
    metadata = DecodeMetadata(
        block_tables=torch.cat([tables, torch.zeros_like(tables[:1])]).int(),
        context_lens=torch.tensor([21, 4, 0], dtype=torch.int32),
        slot_mapping=slots,
        num_splits=2,
    )
    out = backend.forward(0, q, k, v, cache, metadata)
    assert torch.equal(cache, expected_cache)
    assert relative_error(out[:2], expected[:2]) < 1e-5
    assert torch.equal(out[2], torch.zeros_like(out[2]))


@gpu[0]
@gpu[1]
@pytest.mark.parametrize("query_lens", [[300, 1, 1, 77, 1, 16], [1] * 40, [4] * 12])
def test_gpu_bf16_matches_torch_backend(query_lens):
    generator = torch.Generator().manual_seed(len(query_lens))
    starts = torch.randint(0, 1500, (len(query_lens),), generator=generator).tolist()
    starts[0] = 0
    _compare(query_lens, starts, num_heads=32, num_kv_heads=8, head_dim=128, padded_rows=3,
             dtype=torch.bfloat16, device="cuda", tolerance=1e-2, max_decode_query_len=8)


def test_staged_device_tensors_are_used_as_given():
    backend = TritonAttentionBackend(16)
    tables, slots, cache, q, k, v = _step([3, 1], [0, 20], num_heads=4, num_kv_heads=2, head_dim=32)
    context_lens = torch.tensor([3, 21], dtype=torch.int32)
    query_start_loc = torch.tensor([0, 3, 4], dtype=torch.int32)
    metadata = backend.build_metadata([3, 1], [0, 20], tables, slots, context_lens=context_lens,
                                      query_start_loc=query_start_loc)
    assert metadata.prefill.seq_lens is context_lens and metadata.prefill.query_start_loc is query_start_loc
    reference = TorchAttentionBackend(16)
    expected = reference.forward(0, q, k, v, cache.clone(), reference.build_metadata([3, 1], [0, 20], tables, slots))
    assert relative_error(backend.forward(0, q, k, v, cache, metadata), expected) < 1e-5
