"""prompt_logprobs on the CPU engine over a tiny random Qwen3, against the same checkpoint in
transformers: every prompt token after the first gets its logprob, rank and top alternatives,
on the request's first delta only, whether the prompt runs in one chunk or several, whether
steps run ahead, and when its blocks are in the prefix cache already."""

from __future__ import annotations

import pytest
import torch

from spillway.protocol.hashing import block_hashes
from spillway.protocol.messages import Generate, RequestDelta, SamplingParams
from spillway.worker.runner.device_settings import WorkerConfig
from spillway.worker.driver.engine import Engine
from tiny_models import TINY_VOCAB, save_tiny_qwen3

PROMPT = torch.randint(2, TINY_VOCAB, (37,), generator=torch.Generator().manual_seed(5)).tolist()
NUM_TOP = 3


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return save_tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3-prompt-logprobs"))


@pytest.fixture(scope="module")
def reference(tiny_model):
    """transformers' log-softmax over the prompt: row p scores token p + 1."""
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM.from_pretrained(tiny_model, torch_dtype=torch.float32).eval()
    with torch.inference_mode():
        return model(torch.tensor([PROMPT])).logits[0, :-1].float().log_softmax(dim=-1)


def run(engine: Engine, request_id: str, prompt_logprobs: int | None) -> list[RequestDelta]:
    params = SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=prompt_logprobs)
    hashes = block_hashes(PROMPT, engine.block_size, engine.root_hash)
    assert engine.add_request(Generate(request_id=request_id, prompt_token_ids=PROMPT, block_hashes=hashes,
                                       params=params)) is None
    deltas = []
    while engine.has_work:
        deltas += [d for d in engine.step() if d.request_id == request_id]
    return deltas


def check_against_reference(deltas: list[RequestDelta], reference: torch.Tensor) -> None:
    entries = deltas[0].prompt_logprobs
    assert all(d.prompt_logprobs is None for d in deltas[1:])
    assert [e.token_id for e in entries] == PROMPT[1:]
    for position, entry in enumerate(entries):
        row = reference[position]
        assert entry.logprob == pytest.approx(row[entry.token_id].item(), abs=1e-3)
        chosen = row[entry.token_id]  # the rank, up to ties within float noise
        assert int((row > chosen + 1e-4).sum()) + 1 <= entry.rank <= int((row > chosen - 1e-4).sum()) + 1
        top = row.topk(NUM_TOP)
        assert entry.top_logprobs == pytest.approx(top.values.tolist(), abs=1e-3)
        assert len(entry.top_token_ids) == NUM_TOP


@pytest.mark.parametrize("max_num_batched_tokens, async_scheduling", [(None, False), (16, False), (16, True)])
def test_prompt_logprobs_match_transformers(tiny_model, reference, max_num_batched_tokens, async_scheduling):
    engine = Engine(WorkerConfig(model=tiny_model, dtype="float32", device="cpu", max_num_seqs=4,
                                 max_num_batched_tokens=max_num_batched_tokens, async_scheduling=async_scheduling))
    check_against_reference(run(engine, "a", NUM_TOP), reference)


def test_a_cached_prompt_is_computed_again_for_its_logprobs(tiny_model, reference):
    engine = Engine(WorkerConfig(model=tiny_model, dtype="float32", device="cpu", max_num_seqs=4))
    first = run(engine, "warm", None)
    assert first[0].prompt_logprobs is None
    again = run(engine, "plain", None)
    assert again[0].num_cached_tokens > 0  # the prompt's blocks are cached
    deltas = run(engine, "scored", NUM_TOP)
    assert deltas[0].num_cached_tokens == 0
    check_against_reference(deltas, reference)


def test_the_offline_api_returns_them_as_vllm_does(tiny_model, reference):
    from spillway.gateway import LLM
    from spillway.gateway import SamplingParams as UserParams

    with LLM(tiny_model, device="cpu", dtype="float32") as llm:
        (output,) = llm.generate([PROMPT], UserParams(max_tokens=2, temperature=0, prompt_logprobs=NUM_TOP),
                                 use_tqdm=False)
        (plain,) = llm.generate([PROMPT], UserParams(max_tokens=2, temperature=0), use_tqdm=False)
    assert output.prompt_logprobs[0] is None and len(output.prompt_logprobs) == len(PROMPT)
    for position, (token_id, entry) in enumerate(zip(PROMPT[1:], output.prompt_logprobs[1:])):
        assert entry[token_id].logprob == pytest.approx(reference[position, token_id].item(), abs=1e-3)
        assert len(entry) in (NUM_TOP, NUM_TOP + 1)  # the top alternatives, and the token when not among them
    assert plain.prompt_logprobs is None
