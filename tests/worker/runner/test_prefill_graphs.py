"""Prefill graphs on the CPU: token buckets, padded staging, and the prefill step a graph
captures, run eagerly over its fixed views, giving the eager path's logits and KV.

The GPU tests add the capture and replay themselves (tests/worker/driver/test_gpu_engine.py).
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from spillway.worker.runner.cuda_graphs import prefill_buckets, prefill_graph_seqs
from spillway.worker.kv_tier.step_graphs import StepGraphs
from spillway.worker.attention.triton_paged import graph_prefill_metadata
from spillway.worker.runner.model_runner import ChunkInput, TokenFeed
from spillway.worker.attention.step_inputs import StepInputs
from tests.worker.runner.test_runner_cuda_path import VOCAB, EagerGraphs, runner_pair

CPU = torch.device("cpu")


def test_prefill_buckets_stop_at_the_step_budget_and_hold_at_most_32_sequences():
    assert prefill_buckets(8192) == [16, 32, 64, 96, 128, 144, 160, 176, 192, 208, 224, 240, 256, 288, 320, 352,
                                     384, 416, 448, 480, 512, 576, 640, 704, 768, 832, 896, 960, 1024, 1152,
                                     1280, 1408, 1536, 1664, 1792, 1920, 2048]
    assert prefill_buckets(300) == [16, 32, 64, 96, 128, 144, 160, 176, 192, 208, 224, 240, 256, 288]
    assert prefill_buckets(128) == [16, 32, 64, 96, 128]
    assert prefill_buckets(100) == [16, 32, 64, 96]
    assert prefill_buckets(8) == []
    assert [prefill_graph_seqs(t, 512) for t in (16, 32, 64, 128, 512)] == [16, 32, 64, 64, 64]
    assert prefill_graph_seqs(512, 4) == 4


def test_past_128_tokens_a_step_pads_less_than_an_eighth_of_its_bucket():
    """Where the matrix products are compute-bound, padding rows cost their share of the step."""
    graphs = StepGraphs(prefill_buckets(8192), CPU, kind="prefill")
    for tokens in range(129, 2049):
        bucket = graphs.bucket_for(tokens)
        assert tokens <= bucket and (bucket - tokens) * 8 < bucket, (tokens, bucket)
    assert graphs.bucket_for(200) == 208  # 50 requests of 4 new tokens on one shared prefix


def test_a_step_takes_the_smallest_bucket_that_holds_its_tokens_and_sequences():
    _, runner, _ = runner_pair("qwen3")
    runner.cuda_graphs.max_num_seqs = 128  # sequences per bucket: min(T, 128, 64); only the choice runs here
    graphs = StepGraphs(prefill_buckets(128), CPU, kind="prefill")
    assert runner.cuda_graphs.token_bucket(graphs, 1, 1) == 16
    assert runner.cuda_graphs.token_bucket(graphs, 16, 3) == 16
    assert runner.cuda_graphs.token_bucket(graphs, 17, 1) == 32
    assert runner.cuda_graphs.token_bucket(graphs, 20, 17) == 32  # 17 sequences do not fit the bucket of 16 tokens
    assert runner.cuda_graphs.token_bucket(graphs, 40, 33) == 64  # 33 sequences take the bucket of 64 tokens
    assert runner.cuda_graphs.token_bucket(graphs, 100, 65) is None  # no bucket holds 65 sequences
    assert runner.cuda_graphs.token_bucket(graphs, 128, 2) == 128
    assert runner.cuda_graphs.token_bucket(graphs, 129, 1) is None  # beyond the largest bucket: eager


def test_padded_staging_writes_the_chunks_then_padding_rows_and_sequences():
    inputs = StepInputs(max_num_tokens=64, max_num_seqs=4, max_blocks_per_seq=5, block_size=4, device=CPU)
    chunks = [ChunkInput([11, 12, 13], 5, [7, 2, 9]), ChunkInput([21], 2, [4])]
    layout = inputs.stage_prefill(chunks, 16, 4)
    assert layout.input_ids.tolist() == [11, 12, 13, 21] + [0] * 12
    assert layout.positions.tolist() == [5, 6, 7, 2] + [0] * 12
    # position p of a table lives at slot table[p // 4] * 4 + p % 4
    assert layout.slot_mapping.tolist() == [2 * 4 + 1, 2 * 4 + 2, 2 * 4 + 3, 4 * 4 + 2] + [-1] * 12
    assert layout.query_start_loc.tolist() == [0, 3, 4, 4, 4]
    assert layout.context_lens.tolist() == [8, 3, 0, 0]
    assert layout.last_rows.tolist() == [2, 3, 0, 0]
    assert layout.block_tables.shape == (4, 5)
    assert layout.block_tables[0, :2].tolist() == [7, 2] and layout.block_tables[1, 0].item() == 4
    # The graph's views are the same memory every step.
    fixed = inputs.prefill_layout(16, 4)
    assert fixed.input_ids.data_ptr() == layout.input_ids.data_ptr()
    assert fixed.block_tables.data_ptr() == layout.block_tables.data_ptr()
    inputs.pad_prefill(16, 4)
    assert fixed.slot_mapping.tolist() == [-1] * 16 and fixed.context_lens.tolist() == [0] * 4
    assert fixed.query_start_loc.tolist() == [0] * 5


def test_padded_staging_refuses_what_the_bucket_cannot_hold():
    inputs = StepInputs(max_num_tokens=64, max_num_seqs=4, max_blocks_per_seq=2, block_size=4, device=CPU)
    for chunks, rows, seqs, message in (
        ([ChunkInput([1] * 17, 0, [0, 1, 2, 3, 4])], 16, 4, "exceed a graph of 16 tokens"),
        ([ChunkInput([1], 0, [0])] * 3, 16, 2, "3 sequences exceed"),
        ([ChunkInput([1], 8, [0, 1, 2])], 16, 4, "exceeds the limit of 2"),
    ):
        try:
            inputs.stage_prefill(chunks, rows, seqs)
        except ValueError as error:
            assert message in str(error)
        else:
            raise AssertionError(f"staged {chunks}")


def test_prefill_graph_steps_give_the_eager_logits_and_kv():
    """Prompts, an extend after a cached prefix, and prefill mixed with decodes fed from the
    device, through the prefill graphs' step (bucket padding included) on one runner and
    eagerly on the plain-torch runner; the KV caches must agree at the end, so no padded row
    wrote a slot."""
    torch_runner, kernel_runner, _ = runner_pair("qwen3")
    kernel_runner.cuda_graphs.prefill = graphs = EagerGraphs(kernel_runner, kind="prefill")
    rng = random.Random(2)
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (5, 16, 33)]
    tables = [[0, 9, 13], [3, 17, 4, 21], [11, 2, 7, 20]]

    def both(chunks, feed=None):
        expected = torch_runner.execute(chunks if feed is None else resolved(chunks, feed))
        got = kernel_runner.execute(chunks, feed)
        assert got.shape == expected.shape
        assert (got - expected).abs().max().item() < 1e-4
        return expected.argmax(-1).tolist()

    def resolved(chunks, feed):
        chunks = list(chunks)
        for row, source in zip(feed.rows, feed.sources):
            c = chunks[row]
            chunks[row] = ChunkInput([int(feed.tokens[source])], c.start, c.slot_table)
        return chunks

    # 54 tokens in 3 sequences: the bucket of 64.
    first = both([ChunkInput(p, 0, t) for p, t in zip(prompts, tables)])
    # An extend: 7 new tokens after the first prompt's 5 cached ones (bucket 16).
    extra = [rng.randrange(VOCAB) for _ in range(7)]
    both([ChunkInput(extra, 5, tables[0])])
    sequences = [prompts[0] + extra, prompts[1] + [first[1]], prompts[2] + [first[2]]]
    # Mixed: two decodes, one fed from the device, and a 9-token chunk of the first sequence.
    more = [rng.randrange(VOCAB) for _ in range(9)]
    fed = TokenFeed([1], [0], torch.tensor([sequences[2][-1], 5]))
    mixed = [ChunkInput([sequences[1][-1]], len(sequences[1]) - 1, tables[1]),
             ChunkInput([0], len(sequences[2]) - 1, tables[2]),
             ChunkInput(more, len(sequences[0]), tables[0])]
    both(mixed, fed)
    assert graphs.replayed == [64, 16, 16]
    torch.testing.assert_close(kernel_runner.kv_cache, torch_runner.kv_cache, rtol=1e-5, atol=1e-5)
    # Those graphs split their keys (one sequence's few tiles; the CPU counts as 8 multiprocessors).
    layout = kernel_runner.inputs.prefill_layout(64, 4)
    metadata = graph_prefill_metadata(layout.query_start_loc, layout.context_lens, layout.block_tables,
                                      layout.slot_mapping, 64, num_heads=6, num_kv_heads=3, head_dim=32)
    assert metadata.num_splits == 4 and metadata.max_query_len == 64


def test_steps_beyond_the_largest_bucket_run_eagerly():
    torch_runner, kernel_runner, _ = runner_pair("llama")
    kernel_runner.cuda_graphs.prefill = graphs = EagerGraphs(kernel_runner, kind="prefill")
    kernel_runner.cuda_graphs.prefill.buckets = [16]
    kernel_runner.cuda_graphs.prefill.max_bucket = 16
    rng = np.random.default_rng(3)
    chunks = [ChunkInput(rng.integers(0, VOCAB, 20).tolist(), 0, [1, 2])]
    got, expected = kernel_runner.execute(chunks), torch_runner.execute(chunks)
    assert (got - expected).abs().max().item() < 1e-4
    assert graphs.replayed == []


def test_warm_up_runs_one_eager_step_in_the_pools_first_blocks_and_skips_a_pool_too_small():
    _, runner, _ = runner_pair("qwen3")  # 24 blocks of 16 tokens, steps of up to 128 tokens
    runner.kv_cache.zero_()
    runner.warm_up(num_tokens=40)  # 3 blocks
    written = runner.kv_cache.flatten(1).abs().sum(dim=1) > 0
    assert written.tolist() == [True] * 3 + [False] * 21
    runner.kv_cache.zero_()
    runner.warm_up(num_tokens=513)  # capped at the 128-token step: 8 blocks
    assert (runner.kv_cache.flatten(1).abs().sum(dim=1) > 0).sum().item() == 8
    runner.kv_cache = torch.zeros_like(runner.kv_cache[:2])
    runner.warm_up(num_tokens=40)  # 3 blocks do not fit a pool of 2: nothing runs
    assert runner.kv_cache.abs().sum().item() == 0


@pytest.mark.parametrize("num_rows,num_seqs", [(513, 1), (8192, 64), (8191, 63), (7, 3), (130, 129)])
def test_every_field_starts_16_byte_aligned_and_eager_tables_are_16_entries_wide(num_rows, num_seqs):
    """Triton compiles a kernel variant per combination of pointer alignments and of integer
    arguments that are 1 or multiples of 16: one combination for every step shape means no
    compile inside a request."""
    block_size = 16
    inputs = StepInputs(max_num_tokens=8192, max_num_seqs=256, max_blocks_per_seq=64, block_size=block_size,
                        device=CPU)
    per_seq = [num_rows // num_seqs + (seq < num_rows % num_seqs) for seq in range(num_seqs)]
    chunks = [ChunkInput([1] * n, 3, list(range(-(-(n + 3) // block_size)))) for n in per_seq]
    layout = inputs.stage(chunks)
    fields = [layout.input_ids, layout.positions, layout.slot_mapping, layout.last_rows, layout.context_lens,
              layout.query_start_loc, layout.block_tables]
    assert all(field.data_ptr() % 16 == 0 for field in fields)
    assert layout.block_tables.shape[1] % 16 == 0 and layout.block_tables.stride(0) % 16 == 0
    assert layout.query_start_loc.tolist()[-1] == num_rows and layout.context_lens.tolist() == [n + 3 for n in per_seq]
