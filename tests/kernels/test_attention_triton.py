"""TritonAttentionBackend against TorchAttentionBackend: the same step through both, the same
cache afterwards, the same outputs; mixed, decode-only and speculative batches; steps whose
sequences share a cached prefix (the cascade path); the tensors-only DecodeMetadata with
padding rows, as a CUDA-graph step uses it."""

import pytest
import torch
from kernel_testing import gpu, random_tensor, relative_error

from spillway.worker.attention.torch_paged import TorchAttentionBackend
from spillway.worker.attention.triton_paged import DecodeMetadata, TritonAttentionBackend
from spillway.worker.attention.shared_prefix import CASCADE_MIN_TOKENS, shared_prefix_len


def _step(query_lens, starts, *, num_heads, num_kv_heads, head_dim, block_size=16, padded_rows=0,
          dtype=torch.float32, device="cpu", seed=0, shared_blocks=0):
    """A batch: block tables (int64, 0-padded), slots (-1 for padded rows), q/k/v and a cache.
    Every sequence's first `shared_blocks` blocks are sequence 0's."""
    device = torch.device(device)
    generator = torch.Generator().manual_seed(seed)
    context_lens = [start + n for start, n in zip(starts, query_lens)]
    needed = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(needed) + 2
    order = torch.randperm(num_blocks, generator=generator).tolist()
    tables = torch.zeros(len(query_lens), max(needed), dtype=torch.int64)
    slots = []
    for seq, (start, n, count) in enumerate(zip(starts, query_lens, needed)):
        shared = min(shared_blocks, count) if seq else 0
        tables[seq, :shared] = tables[0, :shared]
        tables[seq, shared:count] = torch.tensor(order[: count - shared])
        order = order[count - shared :]
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
        host_tables = {"host_block_tables": tables.cpu()} if isinstance(backend, TritonAttentionBackend) else {}
        metadata = backend.build_metadata(query_lens, starts, tables, slots, **host_tables)
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
    from spillway.worker.runner.model_runner import MAX_VERIFY_QUERY_LEN, default_backend

    cuda = torch.device("cuda")
    assert default_backend(cuda, 16).max_decode_query_len == 1
    assert default_backend(cuda, 16, verifies=True).max_decode_query_len == MAX_VERIFY_QUERY_LEN


def test_a_latent_model_gets_the_latent_kernels_on_cuda_and_plain_torch_elsewhere():
    from spillway.worker.attention.torch_paged import TorchAttentionBackend
    from spillway.worker.attention.triton_latent import LatentAttentionBackend
    from spillway.worker.runner.model_runner import MAX_VERIFY_QUERY_LEN, default_backend

    backend = default_backend(torch.device("cuda"), 16, verifies=True, scale=0.1, kv_lora_rank=512)
    assert isinstance(backend, LatentAttentionBackend)
    assert (backend.kv_lora_rank, backend.scale, backend.max_decode_query_len) == (512, 0.1, MAX_VERIFY_QUERY_LEN)
    assert isinstance(default_backend(torch.device("cpu"), 16, scale=0.1, kv_lora_rank=512), TorchAttentionBackend)


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


@gpu[0]
@gpu[1]
def test_gpu_bf16_cascade_matches_torch_backend():
    query_lens = [4] * 12 + [1, 1, 30]
    generator = torch.Generator().manual_seed(0)
    starts = (4096 + torch.randint(0, 600, (len(query_lens),), generator=generator)).tolist()
    metadata = _compare(query_lens, starts, num_heads=32, num_kv_heads=8, head_dim=128, padded_rows=3,
                        dtype=torch.bfloat16, device="cuda", tolerance=1e-2, shared_blocks=4096 // 16)
    assert metadata.shared_prefix_len == 4096


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


def _tables(*rows: list[int]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int32)


def test_shared_prefix_is_found_up_to_the_first_differing_column():
    tables = _tables([7, 8, 9, 3, 0], [7, 8, 9, 4, 5], [7, 8, 9, 3, 6])
    assert shared_prefix_len([64, 50, 60], tables, 16, min_tokens=32) == 48  # column 3 differs


def test_shared_prefix_is_cut_to_the_earliest_start():
    """A sequence whose new tokens begin inside the shared blocks would see them under a causal
    mask: the prefix ends at the last whole block before every start, or is not used."""
    tables = _tables([7, 8, 9, 3], [7, 8, 9, 3], [7, 8, 9, 3])
    assert shared_prefix_len([64, 40, 60], tables, 16, min_tokens=32) == 32
    assert shared_prefix_len([64, 31, 60], tables, 16, min_tokens=32) == 0  # 1 block: under the minimum


def test_no_shared_prefix_for_one_sequence_or_a_differing_first_block():
    assert shared_prefix_len([64], _tables([7, 8, 9, 3]), 16, min_tokens=16) == 0
    assert shared_prefix_len([64, 64], _tables([7, 8, 9, 3], [2, 8, 9, 3]), 16, min_tokens=16) == 0


def test_shared_prefix_under_the_minimum_is_not_used():
    blocks = CASCADE_MIN_TOKENS // 16
    tables = torch.arange(blocks + 1, dtype=torch.int32).repeat(2, 1)
    tables[1, blocks - 1 :] = 999  # the tables differ from the last block of the minimum on
    assert shared_prefix_len([CASCADE_MIN_TOKENS + 16] * 2, tables, 16) == 0
    tables[1, blocks - 1] = tables[0, blocks - 1]
    assert shared_prefix_len([CASCADE_MIN_TOKENS + 16] * 2, tables, 16) == CASCADE_MIN_TOKENS


SHARED = CASCADE_MIN_TOKENS // 16 + 1  # blocks of 16 shared by every sequence below


@pytest.mark.parametrize("query_lens,own", [([4, 1, 3], [0, 40, 7]), ([1, 1, 1], [5, 0, 70])],
                         ids=["extends", "decodes"])
def test_steps_sharing_a_prefix_take_the_cascade_path(query_lens, own):
    """The forward over a shared prefix (decodes too) equals the plain-torch backend's."""
    starts = [SHARED * 16 + n for n in own]
    metadata = _compare(query_lens, starts, num_heads=4, num_kv_heads=2, head_dim=32, padded_rows=2,
                        shared_blocks=SHARED)
    assert metadata.shared_prefix_len == SHARED * 16 and metadata.prefill is not None


def test_the_staged_host_tables_find_the_shared_prefix():
    from spillway.worker.runner.model_runner import ChunkInput
    from spillway.worker.attention.step_inputs import StepInputs

    inputs = StepInputs(max_num_tokens=8, max_num_seqs=2, max_blocks_per_seq=SHARED + 2, block_size=16,
                        device=torch.device("cpu"))
    prefix = list(range(SHARED))
    start = SHARED * 16 + 3
    layout = inputs.stage([ChunkInput([1, 2], start, prefix + [SHARED]), ChunkInput([3], start, prefix + [SHARED + 1])])
    assert layout.host_block_tables is not None
    assert TritonAttentionBackend(16).metadata_for(layout).shared_prefix_len == SHARED * 16
