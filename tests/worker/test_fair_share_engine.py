"""A short request beside a client request of n=16 choices that holds every sequence slot and
KV block, on the CPU engine with a tiny Qwen3: its first token comes in the first step after
it arrives, and a token in every step after that."""

from __future__ import annotations

import pytest
from tiny_models import save_tiny_qwen3

from spillway.protocol.config import WorkerConfig
from spillway.protocol.messages import Generate, SamplingParams
from spillway.worker.engine import Engine

HOG_PROMPT = [(7 * i) % 300 + 2 for i in range(96)]  # 6 blocks of 16
SHORT = Generate(request_id="short", prompt_token_ids=[5, 6, 7, 8], block_hashes=[],
                 params=SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3"))


def engine_for(model_dir) -> Engine:
    # 16 choices of 96 + 32 tokens need 8 blocks each (the prompt's 6 shared once cached): 40 blocks
    # hold five whole.
    engine = Engine(WorkerConfig(model=str(model_dir), device="cpu", dtype="float32", max_num_seqs=16,
                                 max_model_len=256, num_gpu_blocks_override=40))
    return engine


def test_a_short_request_beside_an_n16_hog_gets_a_token_in_each_of_its_first_steps(model_dir):
    engine = engine_for(model_dir)
    for i in range(16):
        assert engine.add_request(Generate(
            request_id=f"hog-{i}", prompt_token_ids=HOG_PROMPT, block_hashes=[], parent_id="hog",
            params=SamplingParams(max_tokens=32, temperature=1.0, seed=i, ignore_eos=True))) is None
    tokens: dict[str, list[int]] = {}

    def collect(step: int) -> list[int]:
        """The steps, of those given, in which the short request got a token."""
        got = []
        for delta in engine.step():
            assert delta.error is None
            tokens.setdefault(delta.request_id, []).extend(delta.new_token_ids)
            got += [step] if delta.request_id == "short" else []
        return got

    for _ in range(3):
        collect(0)
    assert engine.scheduler.block_manager.num_free_blocks == 0  # the hog holds the whole pool
    assert engine.add_request(SHORT) is None
    short_steps = []  # counted from its arrival
    step = 0
    while engine.has_work and step < 400:
        step += 1
        short_steps += collect(step)
    assert short_steps == [1, 2, 3, 4]
    assert engine.scheduler.num_preemptions > 0  # the hog's own choices gave way
    assert [len(tokens[f"hog-{i}"]) for i in range(16)] == [32] * 16

    alone = engine_for(model_dir)
    alone.add_request(SHORT)
    alone_tokens = []
    while alone.has_work:
        alone_tokens += [t for delta in alone.step() for t in delta.new_token_ids]
    assert tokens["short"] == alone_tokens
