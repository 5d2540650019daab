"""Grammar masks on the logits (worker/sample/token_masks.py): the bits of each constrained row,
token t at bit t % 32 of word t // 32, leave exactly those tokens; other rows are untouched;
the sampler takes them first, so greedy and drawn tokens are allowed ones."""

from __future__ import annotations

import torch

from spillway.protocol.messages import SamplingParams
from spillway.worker.sample.sampler import Sampler, SamplingInput
from spillway.worker.sample.token_masks import HostBitmask, apply_token_bitmask


def bitmask_of(allowed: list[set[int]], vocab_size: int) -> torch.Tensor:
    words = torch.zeros(len(allowed), (vocab_size + 31) // 32, dtype=torch.int64)
    for row, tokens in enumerate(allowed):
        for token in tokens:
            words[row, token // 32] |= 1 << (token % 32)
    # int32 words as the libraries write them: bit 31 set is a negative number.
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def test_each_constrained_row_keeps_exactly_its_tokens():
    vocab_size = 100  # not a multiple of 32: the last word's high bits are past the vocabulary
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(4, vocab_size, generator=generator)
    allowed = [{0, 31, 32, 63, 99}, {5}]
    masked = apply_token_bitmask(logits, bitmask_of(allowed, vocab_size), torch.tensor([1, 3]))
    for row, tokens in ((1, allowed[0]), (3, allowed[1])):
        finite = set(torch.isfinite(masked[row]).nonzero().flatten().tolist())
        assert finite == tokens
        assert torch.equal(masked[row, sorted(tokens)], logits[row, sorted(tokens)])
    assert torch.equal(masked[[0, 2]], logits[[0, 2]])


def test_the_sampler_picks_allowed_tokens_greedy_and_drawn():
    vocab_size = 64
    logits = torch.randn(3, vocab_size, generator=torch.Generator().manual_seed(1))
    allowed = [{7, 40}, {3}, {50, 51, 52}]
    host = HostBitmask(bitmask_of([set()] * 3, vocab_size), torch.device("cpu"))
    rows = [0, 1, 2]
    masks = host.send(rows, lambda bitmask, k: bitmask[k].copy_(bitmask_of([allowed[k]], vocab_size)[0]))
    inputs = [SamplingInput("a", SamplingParams(temperature=0.0), [], []),
              SamplingInput("b", SamplingParams(temperature=0.0), [], []),
              SamplingInput("c", SamplingParams(temperature=1.0, seed=5), [], [])]
    tokens = Sampler([0]).sample_ids(logits, inputs, masks).tolist()
    assert tokens[0] == max(allowed[0], key=lambda t: logits[0, t].item())
    assert tokens[1] == 3
    assert tokens[2] in allowed[2]
