"""The draft model's CUDA graphs, on the CPU: the proposer's runner captures them only when
asked, decode batches up to the switch's largest; proposals through the graphs' steps (run
eagerly over their fixed views) equal those of the plain-torch path, with catch-up forwards
that replay a graph after the logits of an earlier one were kept."""

from __future__ import annotations

import random

import pytest
import torch
import transformers

from spillway.protocol.config import SpeculativeConfig
from spillway.protocol.messages import SamplingParams
from spillway.worker.runner.model_runner import ModelRunner
from spillway.worker.core.request import Request
from spillway.worker.sample.sampler import Sampler
from spillway.worker.speculative.draft_model import DraftModelProposer
from spillway.worker.speculative.setup import build_spec_decoder
from tests.worker.runner.test_runner_cuda_path import TINY_CONFIGS, VOCAB, EagerGraphs, runner_pair
from tests.worker.speculative.test_spec_engine import checkpoints, tiny_model  # noqa: F401 (fixtures)

CPU = torch.device("cpu")


@pytest.fixture
def small_qwen3(monkeypatch):
    """runner_pair's Qwen3 in one layer of two query heads sharing one KV head: the graphs'
    fixed views, buckets and padding are what these tests compare with the eager path, and the
    Triton interpreter runs every program of every layer and head (test_runner_cuda_path.py
    checks the kernels' path over two layers and three KV heads against plain torch)."""
    monkeypatch.setitem(TINY_CONFIGS, "qwen3", lambda: transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, max_position_embeddings=256, rms_norm_eps=1e-6,
    ))


@pytest.mark.parametrize("cuda_graphs, max_num_seqs, expected", [(True, 8, [5]), (True, 4, [4]), (False, 8, [])])
def test_a_draft_model_captures_graphs_up_to_the_switchs_batch_only_when_asked(
        tiny_model, monkeypatch, cuda_graphs, max_num_seqs, expected):  # noqa: F811
    captured = []
    monkeypatch.setattr(ModelRunner, "capture_graphs",
                        lambda runner, max_batch_size, verify=False: captured.append((max_batch_size, verify)))
    config = SpeculativeConfig(method="draft_model", model=tiny_model, num_speculative_tokens=3,
                               disable_by_batch_size=5)
    build_spec_decoder(config, Sampler([1], seed=0, device=CPU), target_vocab_size=384, device=CPU,
                       dtype=torch.float32, max_model_len=128, max_num_seqs=max_num_seqs, block_size=8,
                       max_num_batched_tokens=256, cuda_graphs=cuda_graphs)
    assert captured == [(size, False) for size in expected]


def requests(prompts: list[list[int]]) -> list[Request]:
    greedy = SamplingParams(temperature=0.0, max_tokens=64)
    return [Request(f"r{i}", list(prompt), greedy, [], i) for i, prompt in enumerate(prompts)]


def test_proposals_through_the_graphs_equal_the_eager_ones(small_qwen3):
    torch_runner, kernel_runner, _ = runner_pair("qwen3")
    assert kernel_runner.model.num_layers == 1
    kernel_runner.cuda_graphs.decode = decode = EagerGraphs(kernel_runner, 4)
    kernel_runner.cuda_graphs.prefill = prefill = EagerGraphs(kernel_runner, kind="prefill")
    # Catch-up forwards of at most 40 tokens: the prompts take three, the first two of which
    # finish requests whose logits must outlive the next replay.
    eager, graphed = (DraftModelProposer(runner, 24, 40) for runner in (torch_runner, kernel_runner))
    rng = random.Random(3)
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (30, 9, 50)]
    eager_requests, graphed_requests = requests(prompts), requests(prompts)
    for accepted in (1, 3, 0, 2):
        expected = [p.token_ids for p in eager.propose(eager_requests, [3, 3, 3])]
        got = [p.token_ids for p in graphed.propose(graphed_requests, [3, 3, 3])]
        assert got == expected and all(len(tokens) == 3 for tokens in got)
        for request_list in (eager_requests, graphed_requests):  # the accepted drafts, then a token
            for request, drafts in zip(request_list, expected):
                for token in [*drafts[:accepted], 5 + accepted]:
                    request.append_token(token)
    # The draft holds the KV of the drafts it fed itself: a request catches up over one token,
    # two after a fully accepted run (the last draft was never fed), a whole prompt at first.
    assert prefill.replayed == [64, 64, 16, 16]
    assert decode.replayed == [4] * 10  # two single-token steps of three requests per round, and 2 catch-ups
