"""A short request beside a client request of n=64 choices that holds every KV block, on the
CPU engine with a tiny Qwen3: its first token comes in the first step after it arrives, and a
token in every step after that, the same tokens it gets alone."""

from __future__ import annotations

import pytest
from tiny_models import save_tiny_qwen3

from spillway.protocol.config import WorkerConfig
from spillway.protocol.messages import Generate, SamplingParams
from spillway.worker.driver.engine import Engine

HOG_N = 64
HOG_PROMPT = [(7 * i) % 300 + 2 for i in range(96)]  # 6 blocks of 16
SHORT = Generate(request_id="short", prompt_token_ids=[5, 6, 7, 8], block_hashes=[],
                 params=SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3"))


def engine_for(model_dir) -> Engine:
    # 48 blocks of 16: the hog's first step takes them all (its choices, admitted together,
    # each prefill the prompt), and 64 choices of 96 + 32 tokens never fit.
    engine = Engine(WorkerConfig(model=str(model_dir), device="cpu", dtype="float32", max_num_seqs=HOG_N,
                                 max_model_len=256, num_gpu_blocks_override=48))
    engine.debug_invariants = True  # the block manager's invariants after every step
    return engine


def test_a_short_request_beside_an_n64_hog_gets_a_token_in_each_of_its_first_steps(model_dir):
    engine = engine_for(model_dir)
    for i in range(HOG_N):
        assert engine.add_request(Generate(
            request_id=f"hog-{i}", prompt_token_ids=HOG_PROMPT, block_hashes=[], parent_id="hog",
            params=SamplingParams(max_tokens=32, temperature=1.0, seed=i, ignore_eos=True))) is None
    tokens: dict[str, list[int]] = {}

    def step_once() -> bool:
        """One engine step; whether it gave the short request a token."""
        got = False
        for delta in engine.step():
            assert delta.error is None
            tokens.setdefault(delta.request_id, []).extend(delta.new_token_ids)
            got |= delta.request_id == "short"
        return got

    for _ in range(3):
        step_once()
    assert engine.scheduler.block_manager.num_free_blocks == 0  # the hog holds the whole pool
    hog_tokens_before = sum(map(len, tokens.values()))
    assert engine.add_request(SHORT) is None
    short_steps = [step for step in range(1, 9) if step_once()]  # counted from its arrival
    assert short_steps == [1, 2, 3, 4]
    assert engine.scheduler.counts.num_preemptions > 0  # the hog's own choices gave way
    assert sum(len(tokens[f"hog-{i}"]) for i in range(HOG_N) if f"hog-{i}" in tokens) > hog_tokens_before
    engine.abort([f"hog-{i}" for i in range(HOG_N)])
    manager = engine.scheduler.block_manager
    assert not engine.scheduler.has_unfinished and manager.num_free_blocks == manager.num_gpu_blocks

    alone = engine_for(model_dir)
    alone.add_request(SHORT)
    alone_tokens = []
    while alone.has_work:
        alone_tokens += [t for delta in alone.step() for t in delta.new_token_ids]
    assert tokens["short"] == alone_tokens
