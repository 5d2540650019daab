"""Verify graphs on CUDA (skipped without a GPU): the same verification steps through the
captured verify graphs and eagerly, on two runners over one fp32 model, give the same logits
rows (within 1e-3) and the same KV; a step past the largest bucket runs eagerly."""

from __future__ import annotations

import random

import pytest
import torch

from spillway.worker.runner.model_runner import ChunkInput, ModelRunner
from spillway.worker.models import build_model
from tests.worker.driver.test_gpu_engine import random_hf

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CUDA = torch.device("cuda")
BLOCK = 16
VOCAB = 512


def graphed_and_eager_runners(family: str) -> tuple[ModelRunner, ModelRunner, list[int]]:
    """A runner with decode, prefill and verify graphs and an eager one over the same weights,
    and the list of verify buckets the first replays."""
    hf = random_hf(family, torch.float32, vocab=VOCAB)
    model = build_model(hf.config, device=CUDA, dtype=torch.float32)
    model.load_weights(hf.state_dict().items())
    graphed, eager = (ModelRunner(model, num_blocks=64, block_size=BLOCK, device=CUDA, dtype=torch.float32,
                                  max_num_seqs=8, max_num_batched_tokens=512, max_model_len=512) for _ in range(2))
    graphed.capture_graphs(8, verify=True)
    graphs = graphed.cuda_graphs
    assert graphs.verify.buckets == [16, 32, 64, 96, 128, 144, 160, 176, 192, 208, 224, 240, 256]
    assert graphs.logits_rows(1).data_ptr() == graphs.logits_rows(256).data_ptr()  # one buffer, allocated once
    replayed: list[int] = []
    replay = graphs.verify.replay
    graphs.verify.replay = lambda bucket: replayed.append(bucket) or replay(bucket)
    return graphed, eager, replayed


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_verification_through_the_graphs_gives_the_eager_rows(family):
    graphed, eager, replayed = graphed_and_eager_runners(family)
    rng = random.Random(7)
    sequences = [[rng.randrange(VOCAB) for _ in range(n)] for n in (5, 30, 17)]
    pool = list(range(1, 64))
    rng.shuffle(pool)
    pool.insert(0, 0)  # block 0 is a real sequence's: a padded row writing slot 0 would show
    tables = [[pool.pop(0) for _ in range(4)] for _ in sequences]
    for runner in (graphed, eager):
        runner.execute([ChunkInput(s, 0, t) for s, t in zip(sequences, tables)])
    worst = 0.0

    def both(chunks: list[ChunkInput], rows: list[int]) -> list[int]:
        nonlocal worst
        got = graphed.execute(chunks, logits_rows=rows)
        expected = eager.execute(chunks, logits_rows=rows)
        assert got.shape == expected.shape == (len(rows), VOCAB)
        worst = max(worst, (got - expected).abs().max().item())
        return expected.argmax(-1).tolist()

    def verify(requests: list[int], num_drafts: list[int]) -> tuple[list[ChunkInput], list[int]]:
        """A chunk per request (its last token, then random drafts) and all its rows."""
        chunks, rows = [], []
        for i, k in zip(requests, num_drafts):
            rows += range(len(rows), len(rows) + 1 + k)
            drafts = [rng.randrange(VOCAB) for _ in range(k)]
            chunks.append(ChunkInput([sequences[i][-1], *drafts], len(sequences[i]) - 1, tables[i]))
        return chunks, rows

    for k in range(1, 9):  # batch 1 with 1 to 8 drafts; the first row's token is committed
        chunks, rows = verify([0], [k])
        sequences[0].append(both(chunks, rows)[0])
    chunks, rows = verify([0, 1, 2], [3, 0, 6])  # mixed draft counts: 12 rows
    tokens = both(chunks, rows)
    for i, first in zip((0, 1, 2), (0, 4, 5)):
        sequences[i].append(tokens[first])
    # Drafts beside a 40-token prompt chunk (49 tokens), then beside a 300-token one (eager).
    prompt = [rng.randrange(VOCAB) for _ in range(340)]
    prompt_table = [pool.pop(0) for _ in range(22)]
    chunks, rows = verify([1, 2], [2, 5])
    both([*chunks, ChunkInput(prompt[:40], 0, prompt_table)], rows + [48])
    chunks, rows = verify([0, 1], [4, 4])
    both([ChunkInput(prompt[40:], 40, prompt_table), *chunks], [300 + row for row in rows])
    print(f"{family}: max |graph - eager| = {worst:.2e}")
    assert worst < 1e-3
    assert replayed == [16] * 9 + [64]
    torch.testing.assert_close(graphed.kv_cache, eager.kv_cache, rtol=1e-3, atol=1e-3)
