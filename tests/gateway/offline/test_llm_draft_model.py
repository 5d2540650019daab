"""The offline API's speculative decoding with a draft model as vLLM users write it, on the real
default model (SmolLM2-135M-Instruct) drafting for itself on this machine's CPU, at the default
max_model_len: it starts (the draft's pool shares the target's budget), and its greedy outputs
are plain decoding's, token for token, every draft accepted."""

from __future__ import annotations

import pytest

from spillway.gateway import LLM, SamplingParams
from spillway.protocol.local import model_files

pytestmark = pytest.mark.slow

PROMPTS = ["The quick brown fox", "List the days of the week: Monday,"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def token_ids(llm: LLM) -> list[list[int]]:
    return [list(output.outputs[0].token_ids) for output in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_the_default_model_drafting_for_itself_decodes_as_plain_decoding_at_the_default_max_model_len():
    model = str(model_files.default_model_path())
    with LLM(model=model, speculative_model=model, num_speculative_tokens=5) as llm:
        assert llm.ready.max_model_len == 8192  # SmolLM2's max_position_embeddings
        # The CPU's 1 GiB for both pools: 728 blocks of 16 tokens each, over one request of 8,192 + 5.
        assert llm.ready.num_gpu_blocks == 728
        speculated = token_ids(llm)
        stats = llm.stats()
    with LLM(model=model) as plain:
        assert plain.ready.num_gpu_blocks == 1456
        assert speculated == token_ids(plain)
    assert all(len(tokens) == 16 for tokens in speculated)
    assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens > 0
