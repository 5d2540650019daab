"""Verify graphs on the CPU: which graphs a runner captures and the logits buffer they share,
the staged logits-row index, the bucket a step takes, and the verify step a graph captures,
run eagerly over its fixed views, giving the eager path's rows (exactly those asked, in order)
and KV.

The GPU tests add the capture and replay themselves (tests/worker/runner/test_gpu_verify_graphs.py).
"""

from __future__ import annotations

import random

import pytest
import torch

from spillway.protocol.config import SpeculativeConfig
from spillway.worker.runner.cuda_graphs import PREFILL_TOKEN_BUCKETS, GraphBuckets, prefill_buckets
from spillway.worker.kv_tier.step_graphs import StepGraphs
from spillway.worker.runner.model_runner import ChunkInput, TokenFeed
from spillway.worker.attention.step_inputs import StepInputs
from tests.worker.runner.test_draft_graphs import small_qwen3  # noqa: F401 (a fixture)
from tests.worker.runner.test_runner_cuda_path import VOCAB, EagerGraphs, runner_pair
from tests.worker.speculative.test_spec_engine import checkpoints, make_engine, tiny_model  # noqa: F401 (fixtures)

CPU = torch.device("cpu")


def test_verify_buckets_come_only_with_speculation_and_stop_at_256_tokens():
    plain = GraphBuckets.plan(8, 8, 8192, verify=False)
    assert plain.verify == [] and plain.prefill == list(PREFILL_TOKEN_BUCKETS)
    assert plain.logits_rows == 8  # a decode bucket of 8, prefill graphs of at most 8 sequences
    speculative = GraphBuckets.plan(8, 8, 8192, verify=True)
    assert speculative.verify == [16, 32, 64, 96, 128, 144, 160, 176, 192, 208, 224, 240, 256]
    assert speculative.logits_rows == 256
    assert GraphBuckets.plan(8, 8, 100, verify=True).verify == [16, 32, 64, 96]
    assert GraphBuckets.plan(8, 8, 100, verify=True).logits_rows == 96
    # Past 256 sequences the decode buckets set the buffer's size, as without verify graphs.
    assert GraphBuckets.plan(512, 512, 8192, verify=True).logits_rows == 512
    # A prefill graph returns one row per sequence: 64 at most.
    assert GraphBuckets.plan(4, 64, 8192, verify=False).logits_rows == 64
    assert GraphBuckets.plan(4, 128, 8192, verify=False).logits_rows == 64


def test_the_reserved_logits_buffer_grows_to_the_largest_verify_bucket():
    _, runner, _ = runner_pair("qwen3")  # 4 sequences, steps of 128 tokens, 300 tokens of vocabulary
    assert runner.cuda_graphs.logits_bytes(4, verify=False) == 4 * VOCAB * 4
    assert runner.cuda_graphs.logits_bytes(4, verify=True) == 128 * VOCAB * 4
    assert runner.cuda_graphs.logits_bytes(64, verify=False) == 4 * VOCAB * 4  # batches are cut at max_num_seqs


def test_the_executor_captures_verify_graphs_only_with_speculation(tiny_model, monkeypatch):  # noqa: F811
    for speculative, expected in ((SpeculativeConfig(method="ngram", num_speculative_tokens=3), True),
                                  (None, False)):
        executor = make_engine(tiny_model, speculative=speculative).executor
        assert executor.speculative is expected
        captured = []
        monkeypatch.setattr(executor.runner, "capture_graphs",
                            lambda max_batch_size, verify=False: captured.append((max_batch_size, verify)))
        executor.capture_graphs()
        assert captured == [(8, expected)]


def test_verify_staging_writes_the_rows_asked_then_row_0_into_fixed_views():
    inputs = StepInputs(max_num_tokens=64, max_num_seqs=4, max_blocks_per_seq=5, block_size=4, device=CPU)
    chunks = [ChunkInput([11, 12, 13], 5, [7, 2, 9]), ChunkInput([21, 22], 2, [4])]
    layout = inputs.stage_verify(chunks, [4, 2, 0, 3], 16, 4)
    assert layout.logits_rows.tolist() == [4, 2, 0, 3] + [0] * 12
    assert layout.input_ids.tolist() == [11, 12, 13, 21, 22] + [0] * 11
    assert layout.slot_mapping.tolist()[:5] == [9, 10, 11, 18, 19] and layout.slot_mapping.tolist()[5:] == [-1] * 11
    assert layout.query_start_loc.tolist() == [0, 3, 5, 5, 5] and layout.context_lens.tolist() == [8, 4, 0, 0]
    fixed = inputs.verify_layout(16, 4)
    for field in ("input_ids", "slot_mapping", "logits_rows", "block_tables"):
        assert getattr(fixed, field).data_ptr() == getattr(layout, field).data_ptr()
    assert all(getattr(fixed, field).data_ptr() % 16 == 0 for field in ("logits_rows", "block_tables"))
    # The prefill graph of the same bucket reads no logits rows: its tables sit elsewhere.
    assert inputs.prefill_layout(16, 4).logits_rows.numel() == 0
    assert inputs.prefill_layout(16, 4).block_tables.data_ptr() != fixed.block_tables.data_ptr()
    inputs.pad_verify(16, 4)
    assert fixed.logits_rows.tolist() == [0] * 16 and fixed.slot_mapping.tolist() == [-1] * 16
    eager = inputs.stage(chunks, [1, 4])
    assert eager.logits_rows.tolist() == [1, 4] and eager.last_rows.tolist() == [2, 4]


@pytest.mark.parametrize("rows, message", [([0, 5], "are not rows of a step of 5 tokens"),
                                           ([-1], "are not rows"),
                                           ([0] * 17, "17 logits rows exceed a graph of 16 tokens")])
def test_verify_staging_refuses_rows_outside_the_step_or_the_bucket(rows, message):
    inputs = StepInputs(max_num_tokens=64, max_num_seqs=4, max_blocks_per_seq=5, block_size=4, device=CPU)
    with pytest.raises(ValueError, match=message):
        inputs.stage_verify([ChunkInput([1] * 5, 0, [0, 1])], rows, 16, 4)


def test_a_verifying_step_takes_the_smallest_verify_bucket_that_holds_its_tokens_and_sequences():
    _, runner, _ = runner_pair("qwen3")
    runner.cuda_graphs.max_num_seqs = 64  # verify sequences per bucket: min(T, 64, 32); only the choice runs here
    graphs = StepGraphs(GraphBuckets.plan(64, 64, 8192, verify=True).verify, CPU, kind="verify")
    assert graphs.buckets == [16, 32, 64, 96, 128, 144, 160, 176, 192, 208, 224, 240, 256]
    assert runner.cuda_graphs.token_bucket(graphs, 5, 1) == 16  # one request and 4 drafts
    assert runner.cuda_graphs.token_bucket(graphs, 20, 17) == 32
    assert runner.cuda_graphs.token_bucket(graphs, 256, 32) == 256  # 32 requests and 7 drafts each
    assert runner.cuda_graphs.token_bucket(graphs, 66, 33) is None  # verification stops at batches of 32
    prefill = StepGraphs(prefill_buckets(8192), CPU, kind="prefill")
    assert runner.cuda_graphs.token_bucket(prefill, 66, 33) == 96  # a prefill graph holds 64 sequences
    assert runner.cuda_graphs.token_bucket(graphs, 257, 1) is None  # a larger step runs eagerly
    assert runner.cuda_graphs.token_bucket(None, 5, 1) is None  # no verify graphs without speculation
    assert prefill_buckets(8192)[-1] == 2048  # the prefill graphs go further


def test_verify_graph_steps_give_the_eager_rows_in_order_and_the_same_kv(small_qwen3):  # noqa: F811
    """Verification of batch 1 with 1, 4 and 8 drafts, of three requests with 2, 0 and 5, of
    drafts beside a prompt chunk, and prompt-logprob rows beside a decode fed from the device,
    through the verify graphs' step (bucket padding included) on one runner and eagerly on the
    plain-torch runner; the KV caches must agree at the end, so no padded row wrote a slot."""
    torch_runner, kernel_runner, _ = runner_pair("qwen3")
    kernel_runner.cuda_graphs.verify = graphs = EagerGraphs(kernel_runner, kind="verify")
    rng = random.Random(4)
    sequences = [[rng.randrange(VOCAB) for _ in range(n)] for n in (6, 20, 11)]
    tables = [[0, 9, 13], [3, 17, 4], [11, 2, 7]]
    for runner in (torch_runner, kernel_runner):
        runner.execute([ChunkInput(s, 0, t) for s, t in zip(sequences, tables)])

    def both(chunks, rows, feed=None):
        reference = chunks if feed is None else resolved(chunks, feed)
        expected = torch_runner.execute(reference, logits_rows=rows)
        every_row = torch_runner.execute(reference, logits_rows=list(range(sum(len(c.token_ids) for c in chunks))))
        torch.testing.assert_close(expected, every_row[rows], rtol=1e-5, atol=1e-5)  # the rows asked, in order
        got = kernel_runner.execute(chunks, feed, logits_rows=rows)
        assert got.shape == (len(rows), VOCAB)
        assert (got - expected).abs().max().item() < 1e-4
        return expected.argmax(-1).tolist()

    def verify(requests, num_drafts):
        """A verifying chunk per request (its last token, then random drafts) and all its rows."""
        chunks, rows = [], []
        for i, k in zip(requests, num_drafts):
            drafts = [rng.randrange(VOCAB) for _ in range(k)]
            rows += range(len(rows), len(rows) + 1 + k)
            chunks.append(ChunkInput([sequences[i][-1], *drafts], len(sequences[i]) - 1, tables[i]))
        return chunks, rows

    for k in (1, 4, 8):
        chunks, rows = verify([0], [k])
        sequences[0].append(both(chunks, rows)[0])
    chunks, rows = verify([0, 1, 2], [2, 0, 5])
    tokens = both(chunks, rows)
    for i, first in zip((0, 1, 2), (0, 3, 4)):
        sequences[i].append(tokens[first])
    # Drafts beside the first 20 tokens of a new prompt (no row of it is sampled): 26 tokens.
    prompt = [rng.randrange(VOCAB) for _ in range(26)]
    chunks, rows = verify([1, 2], [3, 1])
    both([*chunks, ChunkInput(prompt[:20], 0, [5, 6])], rows)
    # Prompt-logprob rows of the prompt's rest, out of order, beside a decode fed from the device.
    fed = TokenFeed([0], [1], torch.tensor([5, sequences[0][-1]]))
    both([ChunkInput([0], len(sequences[0]) - 1, tables[0]), ChunkInput(prompt[20:], 20, [5, 6])], [0, 5, 1, 3], fed)
    assert graphs.replayed == [16, 16, 16, 16, 32, 16]
    # Eagerly: more rows than the bucket's (a row asked twice), more tokens than the largest bucket.
    both([ChunkInput([sequences[2][-1]], len(sequences[2]) - 1, tables[2])], [0] * 17)
    graphs.buckets, graphs.max_bucket = [16], 16
    chunks, rows = verify([0, 1, 2], [7, 7, 3])
    both(chunks, rows)
    assert graphs.replayed == [16, 16, 16, 16, 32, 16]
    torch.testing.assert_close(kernel_runner.kv_cache, torch_runner.kv_cache, rtol=1e-5, atol=1e-5)


def resolved(chunks: list[ChunkInput], feed: TokenFeed) -> list[ChunkInput]:
    """`chunks` with the fed tokens written in (what the eager reference runs)."""
    chunks = list(chunks)
    for row, source in zip(feed.rows, feed.sources):
        chunk = chunks[row]
        chunks[row] = ChunkInput([int(feed.tokens[source])], chunk.start, chunk.slot_table)
    return chunks
