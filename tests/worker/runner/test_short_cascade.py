"""Cascade attention's short suffix tiles, on the CPU (Triton's interpreter): which token buckets
get a short cascade twin (exactly those a step of only short queries can take), and the choice
per step by its longest query, eagerly (the rows a program that cascade attention is launched
with) and through the graphs (which twin replays; their steps run eagerly over the graphs'
fixed views), with the plain-torch path's logits and KV either way."""

from __future__ import annotations

import pytest
import torch
from tests.worker.runner.test_runner_cuda_path import BLOCK, VOCAB, EagerGraphs, runner_pair

import spillway.worker.attention.triton_paged as attention_triton
from spillway.kernels.cascade_attention import SHORT_SUFFIX_ROWS, SUFFIX_ROWS, short_query_tokens
from spillway.worker.runner.cuda_graphs import GraphBuckets, prefill_buckets
from spillway.worker.kv_tier.step_graphs import StepGraphs
from spillway.worker.runner.model_runner import ChunkInput
from spillway.worker.attention.shared_prefix import CASCADE_MIN_TOKENS

CPU = torch.device("cpu")
PREFIX_BLOCKS = CASCADE_MIN_TOKENS // BLOCK
TO_256 = [16, 32, 64, 96, 128, 144, 160, 176, 192, 208, 224, 240, 256]


@pytest.mark.parametrize("max_num_seqs,max_num_tokens,group,expected", [
    (256, 8192, 4, TO_256),  # 64 sequence slots x 4 tokens
    (256, 512, 4, TO_256),
    (256, 8192, 8, [16, 32, 64, 96, 128]),  # 64 slots x 2 tokens
    (8, 8192, 4, [16, 32]),  # 8 slots x 4 tokens
    (8, 512, 8, [16]),  # 8 slots x 2 tokens
    (50, 8192, 4, TO_256[:10]),  # the convoy, 50 x 4 = 200 tokens, takes the bucket of 208
    (256, 100, 4, [16, 32, 64, 96]),  # no bucket past the step budget
])
def test_short_twins_are_planned_for_the_buckets_a_step_of_short_queries_can_take(max_num_seqs, max_num_tokens,
                                                                                 group, expected):
    tokens = short_query_tokens(group, 128)
    assert tokens == {4: 4, 8: 2}[group]
    planned = GraphBuckets.plan(8, max_num_seqs, max_num_tokens, verify=False, cascade=True,
                                short_query_tokens=tokens)
    assert planned.short_cascade == expected
    assert planned.cascade == planned.prefill
    unshared = GraphBuckets.plan(8, max_num_seqs, max_num_tokens, verify=False, short_query_tokens=tokens)
    assert unshared.cascade == unshared.short_cascade == []


@pytest.mark.parametrize("max_num_seqs,short", [(256, 4), (256, 2), (8, 4), (50, 4), (5, 4), (100, 3)])
def test_the_short_twins_are_exactly_the_buckets_that_steps_of_short_queries_take(max_num_seqs, short):
    """Every step of 2 or more sequences, none longer than `short` tokens, through the runner's
    choice of bucket: the buckets taken are the planned twins, no more and no fewer."""
    _, runner, _ = runner_pair("qwen3")
    runner.cuda_graphs.max_num_seqs = max_num_seqs  # only the choice of bucket runs here
    graphs = StepGraphs(prefill_buckets(8192), CPU, kind="prefill")
    taken = {runner.cuda_graphs.token_bucket(graphs, num_tokens, num_seqs)
             for num_seqs in range(2, min(max_num_seqs, 64) + 1)
             for num_tokens in range(num_seqs, short * num_seqs + 1)}
    planned = GraphBuckets.plan(8, max_num_seqs, 8192, verify=False, cascade=True, short_query_tokens=short)
    assert sorted(taken) == planned.short_cascade


def _runners(family: str, seed: int):
    torch_runner, kernel_runner, _ = runner_pair(family, num_blocks=PREFIX_BLOCKS + 8,
                                                 max_model_len=CASCADE_MIN_TOKENS + 4 * BLOCK)
    cache = torch.randn(kernel_runner.kv_cache.shape, generator=torch.Generator().manual_seed(seed))
    torch_runner.kv_cache.copy_(cache)
    kernel_runner.kv_cache.copy_(cache)
    return torch_runner, kernel_runner


def _launched_rows(monkeypatch) -> list[int]:
    """The suffix rows a program of every cascade attention launch from now on."""
    rows: list[int] = []
    launch = attention_triton.cascade_attention

    def counted(*args, suffix_rows):
        rows.append(suffix_rows)
        return launch(*args, suffix_rows=suffix_rows)

    monkeypatch.setattr(attention_triton, "cascade_attention", counted)
    return rows


def _convoy(query_lens: list[int], first_block: int) -> list[ChunkInput]:
    """Sequences on the same PREFIX_BLOCKS blocks, each with 3 cached tokens of its own in block
    `first_block + i`, then `query_lens[i]` new tokens."""
    prefix = list(range(PREFIX_BLOCKS))
    return [ChunkInput([(7 * seq + 3 * i + 1) % VOCAB for i in range(count)], CASCADE_MIN_TOKENS + 3,
                       [*prefix, first_block + seq]) for seq, count in enumerate(query_lens)]


def _same_logits(kernel_runner, torch_runner, chunks: list[ChunkInput]) -> None:
    got, expected = kernel_runner.execute(chunks), torch_runner.execute(chunks)
    assert got.shape == expected.shape == (len(chunks), VOCAB)
    assert (got - expected).abs().max().item() < 1e-4


def test_an_eager_step_takes_16_row_suffix_tiles_only_where_no_query_is_longer_than_short_query_tokens(monkeypatch):
    torch_runner, kernel_runner = _runners("llama", seed=2)
    assert kernel_runner.short_query_tokens == 4  # 3 query heads a KV head, 4 of them to a 16-row tile
    rows = _launched_rows(monkeypatch)
    num_layers = kernel_runner.model.num_layers
    _same_logits(kernel_runner, torch_runner, _convoy([4, 1, 4], PREFIX_BLOCKS))
    assert rows == [SHORT_SUFFIX_ROWS] * num_layers
    _same_logits(kernel_runner, torch_runner, _convoy([4, 5, 1], PREFIX_BLOCKS + 3))
    assert rows == [SHORT_SUFFIX_ROWS] * num_layers + [SUFFIX_ROWS] * num_layers
    torch.testing.assert_close(kernel_runner.kv_cache, torch_runner.kv_cache, rtol=1e-5, atol=1e-5)


# The graph's padded rows hold whatever its buffers held (unspecified by design, never read):
# the interpreter's numpy says so when that is NaN or huge times something.
@pytest.mark.filterwarnings("ignore:(invalid value|overflow) encountered in multiply:RuntimeWarning")
def test_a_graph_step_replays_the_short_twin_only_where_no_query_is_longer_than_short_query_tokens(monkeypatch):
    """Both steps take the bucket of 32 tokens (17 tokens; 4 sequence slots hold 32 tokens of
    queries of 8 at most, so only 16 and 32 have short twins): the one of queries of at most 8
    tokens replays the short twin, the one with a 9-token query the cascade twin."""
    torch_runner, kernel_runner = _runners("qwen3", seed=3)
    assert kernel_runner.short_query_tokens == 8  # 2 query heads a KV head
    kernel_runner.cuda_graphs.prefill = prefill = EagerGraphs(kernel_runner, kind="prefill")
    kernel_runner.cuda_graphs.cascade = cascade = EagerGraphs(kernel_runner, kind="cascade")
    kernel_runner.cuda_graphs.short_cascade = short = EagerGraphs(kernel_runner, kind="short_cascade")
    assert short.buckets == [16, 32] and cascade.buckets == [16, 32, 64, 96, 128]
    rows = _launched_rows(monkeypatch)
    num_layers = kernel_runner.model.num_layers
    _same_logits(kernel_runner, torch_runner, _convoy([8, 1, 8], PREFIX_BLOCKS))
    assert (short.replayed, cascade.replayed, prefill.replayed) == ([32], [], [])
    assert rows == [SHORT_SUFFIX_ROWS] * num_layers
    _same_logits(kernel_runner, torch_runner, _convoy([8, 9], PREFIX_BLOCKS + 3))
    assert (short.replayed, cascade.replayed, prefill.replayed) == ([32], [32], [])
    assert rows == [SHORT_SUFFIX_ROWS] * num_layers + [SUFFIX_ROWS] * num_layers
    torch.testing.assert_close(kernel_runner.kv_cache, torch_runner.kv_cache, rtol=1e-5, atol=1e-5)
