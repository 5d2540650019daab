"""An engine with a draft model on the CPU: the draft's pool comes out of the budget the
target's pool is sized from (the CPU's fixed KV budget), in proportion to the two models'
bytes a block, so both hold the same number of tokens; a budget that cannot hold one request
of max_model_len and its drafts is refused with the max_model_len that fits."""

from __future__ import annotations

import pytest

from spillway.protocol.config import SpeculativeConfig
from spillway.worker.runner.device_settings import WorkerConfig
from spillway.worker.driver.engine import Engine

from tests.worker.speculative.test_spec_engine import K, VOCAB, checkpoints, save_tiny_model, tiny_model  # noqa: F401 (fixtures)

# The target's block (8 tokens, 2 layers, 2 KV heads of 16, fp32): 4,096 bytes; the draft's
# (1 layer, 1 KV head): 1,024.
TARGET_BLOCK_BYTES, DRAFT_BLOCK_BYTES = 4096, 1024


@pytest.fixture(scope="module")
def draft(tmp_path_factory) -> str:
    return save_tiny_model(tmp_path_factory.mktemp("tiny-draft"), VOCAB, seed=3)


def draft_engine(target: str, draft: str, **settings) -> Engine:
    return Engine(WorkerConfig(model=target, dtype="float32", device="cpu", max_num_seqs=8, block_size=8,
                               speculative=SpeculativeConfig(method="draft_model", model=draft,
                                                             num_speculative_tokens=K), **settings))


def test_the_draft_and_the_target_share_the_cpus_budget_by_their_bytes(tiny_model, draft, monkeypatch):
    monkeypatch.setattr("spillway.worker.runner.executor.CPU_KV_CACHE_BYTES", 1 << 20)
    engine = draft_engine(tiny_model, draft)
    assert engine.runner.kv_block_bytes == TARGET_BLOCK_BYTES
    assert engine.spec.proposer.runner.kv_block_bytes == DRAFT_BLOCK_BYTES
    # 1 MiB // (4,096 + 1,024): 204 blocks each; the target takes what the draft leaves, 205.
    assert engine.spec.proposer.runner.kv_cache.shape[0] == 204
    assert engine.block_manager.num_gpu_blocks == 205


def test_a_budget_short_of_one_request_and_its_drafts_names_the_max_model_len_that_fits(
        tiny_model, draft, monkeypatch):  # noqa: F811
    monkeypatch.setattr("spillway.worker.runner.executor.CPU_KV_CACHE_BYTES", 256 << 10)
    with pytest.raises(ValueError) as refused:
        draft_engine(tiny_model, draft)  # 256 KiB // 5,120 bytes: 51 blocks, and a request takes 65
    assert str(refused.value) == (
        "the KV caches of the model and of its draft model hold 408 tokens (51 blocks of 8), and one request of "
        "max_model_len=512 needs 516 (with its 4 speculative tokens); it fits with max_model_len=404 or less")
    engine = draft_engine(tiny_model, draft, max_model_len=404)
    assert engine.spec.proposer.runner.kv_cache.shape[0] == 51


def test_the_override_sizes_both_pools(tiny_model, draft):  # noqa: F811
    engine = draft_engine(tiny_model, draft, num_gpu_blocks_override=100)
    assert engine.spec.proposer.runner.kv_cache.shape[0] == engine.block_manager.num_gpu_blocks == 100
    with pytest.raises(ValueError, match="holds 480 tokens .* it fits with max_model_len=476 or less or with "
                                         "num_gpu_blocks_override=65$"):
        draft_engine(tiny_model, draft, num_gpu_blocks_override=60)
