"""The runner's steps over a shared cached prefix on the CUDA path, run on the CPU (Triton's
interpreter): found on the staged host tables, attended by cascade attention, eagerly or
through the prefill graphs' cascade twins (their steps run eagerly over the graphs' fixed
views), the same logits as the plain-torch path; and the start-up warm-up compiles it."""

from __future__ import annotations

import pytest

import torch
from tests.worker.runner.test_runner_cuda_path import BLOCK, VOCAB, EagerGraphs, runner_pair

import spillway.worker.attention.triton_paged as attention_triton

from spillway.worker.attention.shared_prefix import CASCADE_MIN_TOKENS
from spillway.worker.runner.model_runner import ChunkInput

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
    chunks = _shared_prefix_chunks()
    got, expected = kernel_runner.execute(chunks), torch_runner.execute(chunks)
    assert [metadata.shared_prefix_len for metadata in found] == [CASCADE_MIN_TOKENS]
    assert (got - expected).abs().max().item() < 1e-4
    assert torch.allclose(kernel_runner.kv_cache, torch_runner.kv_cache, atol=1e-5)


def _shared_prefix_chunks() -> list[ChunkInput]:
    """Three sequences on the same PREFIX_BLOCKS blocks, 6 new tokens in all, one a decode."""
    prefix = list(range(PREFIX_BLOCKS))
    return [ChunkInput([5, 9, 11], CASCADE_MIN_TOKENS + 7, [*prefix, PREFIX_BLOCKS]),
            ChunkInput([3], CASCADE_MIN_TOKENS, [*prefix, PREFIX_BLOCKS + 1]),
            ChunkInput([VOCAB - 1, 2], CASCADE_MIN_TOKENS + 20, [*prefix, PREFIX_BLOCKS + 2, PREFIX_BLOCKS + 3])]


def _graphed_runners(seed: int):
    """The torch and kernel runners over one random cache, the kernel runner's prefill graphs
    and cascade twins run eagerly over their views (EagerGraphs)."""
    torch_runner, kernel_runner, _ = _runners(PREFIX_BLOCKS + 8)
    cache = torch.randn(kernel_runner.kv_cache.shape, generator=torch.Generator().manual_seed(seed))
    torch_runner.kv_cache.copy_(cache)
    kernel_runner.kv_cache.copy_(cache)
    kernel_runner.cuda_graphs.prefill = prefill = EagerGraphs(kernel_runner, kind="prefill")
    kernel_runner.cuda_graphs.cascade = cascade = EagerGraphs(kernel_runner, kind="cascade")
    return torch_runner, kernel_runner, prefill, cascade


# The graph's padded rows hold whatever its buffers held (unspecified by design, never read):
# the interpreter's numpy says so when that is NaN or huge times something.
@pytest.mark.filterwarnings("ignore:(invalid value|overflow) encountered in (multiply|reduce):RuntimeWarning")
def test_a_prefill_graph_step_on_a_shared_prefix_replays_the_cascade_twin(monkeypatch):
    """The step takes the bucket of 16 tokens; its cascade twin attends with the prefix length
    it reads from the staged inputs, the prefix split 4 ways (sized for the tables' reach of
    1,088 tokens: 16 rows x 3 KV heads on the CPU's 8 stand-in multiprocessors). A step with
    no shared prefix replays the plain prefill graph."""
    torch_runner, kernel_runner, prefill, cascade = _graphed_runners(seed=1)
    launches = []
    launch = attention_triton.cascade_attention

    def counted(*args, suffix_rows):
        launches.append((int(args[-2][0]), args[-1]))
        return launch(*args, suffix_rows=suffix_rows)

    monkeypatch.setattr(attention_triton, "cascade_attention", counted)
    chunks = _shared_prefix_chunks()
    got, expected = kernel_runner.execute(chunks), torch_runner.execute(chunks)
    assert (cascade.replayed, prefill.replayed) == ([16], [])
    assert launches == [(CASCADE_MIN_TOKENS, 4)] * kernel_runner.model.num_layers
    assert (got - expected).abs().max().item() < 1e-4
    unshared = [ChunkInput([7, 8], 30, [PREFIX_BLOCKS + 4, PREFIX_BLOCKS + 5]), chunks[1]]
    got, expected = kernel_runner.execute(unshared), torch_runner.execute(unshared)
    assert (cascade.replayed, prefill.replayed) == ([16], [16])
    assert len(launches) == kernel_runner.model.num_layers
    assert (got - expected).abs().max().item() < 1e-4
    assert torch.allclose(kernel_runner.kv_cache, torch_runner.kv_cache, atol=1e-5)


def test_cascade_twins_are_planned_only_where_steps_can_share_a_prefix():
    _, kernel_runner, _ = _runners(PREFIX_BLOCKS + 2)  # tables reach CASCADE_MIN_TOKENS + 4 blocks
    assert kernel_runner.cuda_graphs.buckets(4, verify=False).cascade == [16, 32, 64, 96, 128]
    # 4 sequences of at most 8 tokens (2 query heads a KV head) fill 32 tokens at most
    assert kernel_runner.cuda_graphs.buckets(4, verify=False).short_cascade == [16, 32]
    kernel_runner.cuda_graphs.max_num_seqs = 1
    assert kernel_runner.cuda_graphs.buckets(4, verify=False).cascade == []
    assert kernel_runner.cuda_graphs.buckets(4, verify=False).short_cascade == []
    _, short_runner, _ = runner_pair("qwen3", max_model_len=CASCADE_MIN_TOKENS)
    assert short_runner.cuda_graphs.buckets(4, verify=False).cascade == []


def test_warm_up_runs_a_cascade_step_where_the_pool_holds_one():
    _, kernel_runner, found = _runners(PREFIX_BLOCKS + 2)
    kernel_runner.warm_up(num_tokens=40)
    # cascade steps of 1 + 1 and 1 + 9 new tokens: the suffix pass's short tiles, then its long ones
    assert [metadata.shared_prefix_len for metadata in found] == [0, CASCADE_MIN_TOKENS, CASCADE_MIN_TOKENS]
    assert [metadata.query_lens for metadata in found[1:]] == [[1, 1], [1, kernel_runner.short_query_tokens + 1]]
    _, kernel_runner, found = _runners(PREFIX_BLOCKS + 1)
    kernel_runner.warm_up(num_tokens=40)
    assert [metadata.shared_prefix_len for metadata in found] == [0]
    _, kernel_runner, found = _runners(PREFIX_BLOCKS + 2)
    kernel_runner.max_num_seqs = 1  # one request at a time (batch-1 benchmarks): no step shares a prefix
    kernel_runner.warm_up(num_tokens=40)
    assert [metadata.shared_prefix_len for metadata in found] == [0]



class RecordedEvent:
    """Stands in for a CUDA event that a layer's loads record: its wait is logged."""

    def __init__(self, log: list[tuple[str, int]], layer: int) -> None:
        self.log, self.layer = log, layer

    def wait(self) -> None:
        self.log.append(("wait", self.layer))


# As above: the graph's padded rows hold whatever its buffers held.
@pytest.mark.filterwarnings("ignore:(invalid value|overflow) encountered in (multiply|reduce):RuntimeWarning")
def test_a_step_planned_before_its_loads_land_waits_before_each_layer(monkeypatch):
    """The step's KV still lands layer by layer (worker/kv_tier/copier.py): its graph's step (here run
    eagerly over the graph's views; on a GPU its segments wait, worker/kv_tier/step_graphs.py)
    waits for each layer's event before the layer and computes what the torch path computes;
    logits rows asked for come back the same way, eagerly."""
    torch_runner, kernel_runner, prefill, cascade = _graphed_runners(seed=2)
    log: list[tuple[str, int]] = []
    for index, layer in enumerate(kernel_runner.model.model.layers):
        forward = layer.forward
        monkeypatch.setattr(layer, "forward", lambda *args, index=index, forward=forward: (
            log.append(("layer", index)), forward(*args))[1])
    num_layers = kernel_runner.model.num_layers
    events = [RecordedEvent(log, layer) for layer in range(num_layers)]
    chunks = _shared_prefix_chunks()
    got = kernel_runner.execute(chunks, layer_ready=events)
    assert (cascade.replayed, prefill.replayed) == ([16], [])
    assert log == [(kind, layer) for layer in range(num_layers) for kind in ("wait", "layer")]
    assert (got - torch_runner.execute(chunks)).abs().max().item() < 1e-4
    rows = [0, 2, 5]
    log.clear()
    got = kernel_runner.execute(chunks, logits_rows=rows, layer_ready=events)
    assert (cascade.replayed, prefill.replayed) == ([16], [])
    assert log == [(kind, layer) for layer in range(num_layers) for kind in ("wait", "layer")]
    assert got.shape[0] == 3 and (got - torch_runner.execute(chunks, logits_rows=rows)).abs().max().item() < 1e-4
    assert torch.allclose(kernel_runner.kv_cache, torch_runner.kv_cache, atol=1e-5)
