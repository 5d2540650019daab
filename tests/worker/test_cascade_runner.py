"""The runner's eager step over a shared cached prefix on the CUDA path, run on the CPU (Triton's
interpreter): found on the staged host tables, attended by cascade attention, the same logits
as the plain-torch path; and the start-up warm-up compiles it."""

from __future__ import annotations

import torch
from test_runner_cuda_path import BLOCK, VOCAB, runner_pair

from spillway.worker.attention_triton import CASCADE_MIN_TOKENS
from spillway.worker.model_runner import ChunkInput

PREFIX_BLOCKS = CASCADE_MIN_TOKENS // BLOCK


def _runners(num_blocks: int):
    torch_runner, kernel_runner, _ = runner_pair("qwen3", num_blocks=num_blocks,
                                                 max_model_len=CASCADE_MIN_TOKENS + 4 * BLOCK)
    found = []
    metadata_for = kernel_runner.backend.metadata_for
    kernel_runner.backend.metadata_for = lambda layout: found.append(metadata_for(layout)) or found[-1]
    return torch_runner, kernel_runner, found


def test_a_step_on_a_shared_prefix_runs_cascade_attention_and_matches_the_torch_path():
    torch_runner, kernel_runner, found = _runners(PREFIX_BLOCKS + 8)
    cache = torch.randn(kernel_runner.kv_cache.shape, generator=torch.Generator().manual_seed(0))
    torch_runner.kv_cache.copy_(cache)
    kernel_runner.kv_cache.copy_(cache)
    prefix = list(range(PREFIX_BLOCKS))
    chunks = [ChunkInput([5, 9, 11], CASCADE_MIN_TOKENS + 7, [*prefix, PREFIX_BLOCKS]),
              ChunkInput([3], CASCADE_MIN_TOKENS, [*prefix, PREFIX_BLOCKS + 1]),
              ChunkInput([VOCAB - 1, 2], CASCADE_MIN_TOKENS + 20, [*prefix, PREFIX_BLOCKS + 2, PREFIX_BLOCKS + 3])]
    got, expected = kernel_runner.execute(chunks), torch_runner.execute(chunks)
    assert [metadata.shared_prefix_len for metadata in found] == [CASCADE_MIN_TOKENS]
    assert (got - expected).abs().max().item() < 1e-4
    assert torch.allclose(kernel_runner.kv_cache, torch_runner.kv_cache, atol=1e-5)


def test_warm_up_runs_a_cascade_step_where_the_pool_holds_one():
    _, kernel_runner, found = _runners(PREFIX_BLOCKS + 2)
    kernel_runner.warm_up(num_tokens=40)
    assert [metadata.shared_prefix_len for metadata in found] == [0, CASCADE_MIN_TOKENS]
    _, kernel_runner, found = _runners(PREFIX_BLOCKS + 1)
    kernel_runner.warm_up(num_tokens=40)
    assert [metadata.shared_prefix_len for metadata in found] == [0]
    _, kernel_runner, found = _runners(PREFIX_BLOCKS + 2)
    kernel_runner.max_num_seqs = 1  # one request at a time (batch-1 benchmarks): no step shares a prefix
    kernel_runner.warm_up(num_tokens=40)
    assert [metadata.shared_prefix_len for metadata in found] == [0]

