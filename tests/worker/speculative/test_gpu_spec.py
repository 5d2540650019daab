"""Speculative decoding on CUDA (skipped without a GPU): verification replays the verify graphs
(chunks of 1 + k queries after a cached prefix, beside prompt chunks) while plain decode steps
replay the decode graphs, with asynchronous scheduling on; greedy outputs equal plain decoding
for n-gram lookup, replayed continuations and a draft model equal to the target, whose own
steps replay its graphs and propose what it proposes eagerly."""

from __future__ import annotations

import random

import pytest
import torch

from spillway.protocol.config import SpeculativeConfig
from spillway.worker.speculative.draft_model import DraftModelProposer
from spillway.worker.speculative.proposer import NgramProposer, ReplayProposer

from tests.worker.spec_helpers import run, tokens_and_reasons
from tests.worker.runner.test_draft_graphs import requests
from tests.worker.speculative.test_spec_engine import K, VOCAB, checkpoints, make_engine, mixed_jobs, tiny_model  # noqa: F401 (fixtures)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# A pool of a few hundred blocks: the invariant check every test step walks all of them.
CUDA_SETTINGS = dict(device="cuda", async_scheduling=True, num_gpu_blocks_override=512)


@pytest.mark.parametrize("proposer_kind", ["ngram", "replay", "draft-model"])
def test_greedy_outputs_equal_plain_decoding_on_cuda(tiny_model, proposer_kind):  # noqa: F811
    jobs = mixed_jobs()
    plain = make_engine(tiny_model, speculative=None, **CUDA_SETTINGS)
    expected = run(plain, jobs, None)
    assert plain.runner.cuda_graphs.decode is not None and plain.num_async_steps > 0
    assert plain.runner.cuda_graphs.verify is None  # captured only with speculation
    if proposer_kind == "draft-model":
        engine = make_engine(tiny_model, speculative=SpeculativeConfig(
            method="draft_model", model=tiny_model, num_speculative_tokens=K), **CUDA_SETTINGS)
        proposer = engine.spec.proposer
    else:
        engine = make_engine(tiny_model, **CUDA_SETTINGS)
        proposer = NgramProposer(1, 3) if proposer_kind == "ngram" else ReplayProposer(
            {tuple(job.prompt): expected[job.request_id].tokens for job in jobs})
    replayed, verified = counted(engine.runner.cuda_graphs.verify, "replay"), counted(engine.spec, "verify")
    draft_replayed = counted(proposer.runner.cuda_graphs.decode, "replay") if proposer_kind == "draft-model" else [1]
    got = run(engine, jobs, proposer)
    assert tokens_and_reasons(got) == tokens_and_reasons(expected)
    assert engine.spec.metrics.num_accepted_tokens > 0
    # Every verifying step (at most 8 requests of 1 + 4 rows beside a short prompt) replayed a graph.
    assert len(verified) > 0 and len(replayed) == len(verified)
    assert len(draft_replayed) > 0


def test_draft_model_proposals_through_its_graphs_equal_the_eager_ones(tiny_model):  # noqa: F811
    def load(max_graph_batch_size=None):
        return DraftModelProposer.load(tiny_model, target_vocab_size=VOCAB, device=torch.device("cuda"),
                                       dtype=torch.float32, max_model_len=256, max_num_seqs=8, block_size=8,
                                       max_num_batched_tokens=40, num_speculative_tokens=3,
                                       max_graph_batch_size=max_graph_batch_size)

    eager, graphed = load(), load(max_graph_batch_size=4)
    assert eager.runner.cuda_graphs.decode is None and graphed.runner.cuda_graphs.decode.buckets == [1, 2, 4]
    assert graphed.runner.cuda_graphs.prefill.buckets == [16, 32]  # steps of at most 40 tokens
    graphs = graphed.runner.cuda_graphs
    decode, prefill = counted(graphs.decode, "replay"), counted(graphs.prefill, "replay")
    rng = random.Random(3)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (30, 9, 50)]
    eager_requests, graphed_requests = requests(prompts), requests(prompts)
    for accepted in (1, 3, 0, 2):
        expected = [p.token_ids for p in eager.propose(eager_requests, [3, 3, 3])]
        assert [p.token_ids for p in graphed.propose(graphed_requests, [3, 3, 3])] == expected
        for request_list in (eager_requests, graphed_requests):
            for request, drafts in zip(request_list, expected):
                for token in [*drafts[:accepted], 5 + accepted]:
                    request.append_token(token)
    # Catch-up: forwards of 40, 40 (eager: past the largest bucket) and 9 prompt tokens, then one
    # token per request, or two after the fully accepted run (bucket 16).
    assert len(prefill) == 2 and len(decode) == 10


def counted(owner, name: str) -> list:
    """A list that grows by one each time `owner.name` is called."""
    calls, method = [], getattr(owner, name)

    def wrapper(*args, **kwargs):
        calls.append(1)
        return method(*args, **kwargs)

    setattr(owner, name, wrapper)
    return calls
