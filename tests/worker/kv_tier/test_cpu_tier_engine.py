"""The engine with a CPU tier on the CPU device: both pools in host memory, the same code path
as on a GPU (KVCopier, the plan's copies), a tiny random Llama."""

from __future__ import annotations

import pytest
import torch

from spillway.protocol.config import WorkerConfig
from spillway.protocol.hashing import pack_token_ids
from spillway.protocol.messages import Generate, SamplingParams
from spillway.worker.kv_tier.host_pool import allocate_cpu_pool
from spillway.worker.driver.engine import Engine
from spillway.worker.driver.tier_driver import NullTierDriver, TierDriver, write_ahead_blocks
from spillway.worker.driver.timing import REFERENCE_COPY_BYTES_PER_S, LinkTiming
from spillway.worker.kv_tier.paced_loads import PacedLoads
from tiny_models import TinyCheckpoints, save_tiny_deepseek_v3, save_tiny_qwen3_moe

GREEDY = SamplingParams(max_tokens=4, temperature=0.0)
SEEDED = SamplingParams(max_tokens=4, temperature=1.0, seed=7)


def save_tiny_llama(path) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    LlamaForCausalLM(config).save_pretrained(path)  # head_dim 32, as the CUDA kernels want
    return str(path)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> TinyCheckpoints:
    return TinyCheckpoints(tmp_path_factory.mktemp("tiny-tier"),
                           {"llama": save_tiny_llama, "qwen3_moe": save_tiny_qwen3_moe,
                            "deepseek_v3": save_tiny_deepseek_v3})


@pytest.fixture
def model_dir(request, checkpoints) -> str:
    """A tiny random Llama; a tiny Qwen3-MoE or DeepSeek V3 (latent KV cache: one side) where a
    test asks for "qwen3_moe" or "deepseek_v3" (indirect)."""
    return checkpoints[getattr(request, "param", "llama")]


def engine_for(model_dir, num_cpu_blocks: int) -> Engine:
    """A pool of 4 blocks of 16 tokens: one request of the Llama's whole length (64) at most."""
    engine = Engine(WorkerConfig(model=str(model_dir), device="cpu", dtype="float32", max_num_seqs=4,
                                 max_model_len=64, num_gpu_blocks_override=4,
                                 num_cpu_blocks_override=num_cpu_blocks))
    engine.debug_invariants = True  # the block manager's invariants after every step
    return engine


def run(engine: Engine, request_id: str, prompt: list[int], params: SamplingParams,
        pack: bool = False) -> tuple[list[int], int]:
    """The request's tokens and cached-token count, run to its end; `pack`: the prompt's ids
    sent packed, as the gateway sends them."""
    ids = pack_token_ids(prompt) if pack else prompt
    assert engine.add_request(Generate(request_id=request_id, prompt_token_ids=ids, block_hashes=[],
                                       params=params)) is None
    tokens, cached = [], None
    while engine.has_work:
        for delta in engine.step():
            assert delta.error is None
            tokens += delta.new_token_ids
            if delta.num_cached_tokens >= 0:
                cached = delta.num_cached_tokens
    return tokens, cached


def conversation(engine: Engine, params: SamplingParams, pack: bool = False) -> dict[str, tuple[list[int], int]]:
    """Two turns with a filler between them that takes the whole GPU pool (4 blocks of 16)."""
    turn_1 = [(7 * i) % 90 + 1 for i in range(32)]
    results = {"turn-1": run(engine, "turn-1", turn_1, params, pack)}
    results["filler"] = run(engine, "filler", [(5 * i) % 90 + 2 for i in range(63)], params, pack)
    turn_2 = turn_1 + results["turn-1"][0] + [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    results["turn-2"] = run(engine, "turn-2", turn_2, params, pack)
    return results


@pytest.mark.parametrize("params", [GREEDY, SEEDED, SamplingParams(max_tokens=4, temperature=0.0, repetition_penalty=1.5)],
                         ids=["greedy", "seeded", "penalized"])
def test_packed_prompts_give_the_outputs_of_list_prompts_through_the_tier(model_dir, params):
    """The worker keeps packed ids packed (worker/core/request.py): chunks, the hashes of blocks
    that outputs complete, a penalty over the prompt and the tier's reloads see the same ids."""
    as_lists = conversation(engine_for(model_dir, num_cpu_blocks=8), params)
    assert as_lists["turn-2"][1] == 32
    assert conversation(engine_for(model_dir, num_cpu_blocks=8), params, pack=True) == as_lists


@pytest.mark.parametrize("model_dir", ["llama", "qwen3_moe", "deepseek_v3"], indirect=True)
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_conversation_reloads_its_history_from_the_tier_with_the_same_outputs(model_dir, params):
    with_tier = engine_for(model_dir, num_cpu_blocks=8)
    if "deepseek" in model_dir:  # a block: 3 layers of 16 latent rows (32 + 8 float32 values), one side
        assert with_tier.runner.kv_cache[0].nbytes == 3 * 16 * 40 * 4
    without = engine_for(model_dir, num_cpu_blocks=0)
    outputs = conversation(with_tier, params)
    assert outputs["turn-2"][1] == 32  # turn 1's two prompt blocks, from the CPU tier
    assert conversation(without, params) == {**outputs, "turn-2": (outputs["turn-2"][0], 0)}
    stats = with_tier.stats()
    assert (stats.cached_tokens_gpu, stats.cached_tokens_cpu) == (0, 32)
    assert (stats.cpu_prefix_cache_queries, stats.cpu_prefix_cache_hits) == (32 + 63 + 46, 32)
    block_bytes = with_tier.runner.kv_cache[0].nbytes
    # Stored: turn 1's two blocks (under the filler), then three of the filler's (under turn 2).
    assert stats.kv_offload_bytes_gpu_to_cpu == 5 * block_bytes
    assert stats.kv_offload_bytes_cpu_to_gpu == 2 * block_bytes
    assert stats.kv_offload_seconds_gpu_to_cpu > 0 and stats.kv_offload_seconds_cpu_to_gpu > 0
    assert stats.num_cpu_blocks == 8 and stats.cpu_cache_usage == 5 / 8
    assert with_tier.ready().num_cpu_blocks == 8
    assert without.stats().kv_offload_bytes_gpu_to_cpu == 0


def test_an_engine_without_a_tier_has_the_null_driver_and_plans_no_write_back(model_dir):
    without, with_tier = engine_for(model_dir, num_cpu_blocks=0), engine_for(model_dir, num_cpu_blocks=8)
    assert type(without.tier) is NullTierDriver and type(with_tier.tier) is TierDriver
    assert without.scheduler.write_ahead_blocks == 0
    # The tiny model's blocks: the most a step takes whatever the link's measured rate.
    on_the_h200 = LinkTiming.derive(REFERENCE_COPY_BYTES_PER_S).write_ahead_bytes
    assert with_tier.scheduler.write_ahead_blocks == write_ahead_blocks(with_tier.runner.kv_block_bytes, on_the_h200) > 0
    run(without, "turn-1", [(7 * i) % 90 + 1 for i in range(32)], GREEDY)
    assert not without.idle_write_back() and not without.awaited_load_landed() and not without.waits_for_loads
    assert without.block_manager.num_cached_blocks == 2 and without.reset_prefix_cache()
    assert without.stats().cpu_prefix_cache_queries == 0


def test_a_cpu_tier_larger_than_the_host_memory_is_refused_with_the_numbers(tmp_path):
    """Before the model loads (a model that is not there is not even looked for), and again
    when the pool is allocated, after the weights took their share."""
    config = WorkerConfig(model=str(tmp_path / "never-loaded"), device="cpu", dtype="float32", max_num_seqs=4,
                          num_gpu_blocks_override=4, cpu_offload_gb=1e6)
    with pytest.raises(ValueError, match=r"asks for 1000000\.00 GiB of host memory and [0-9.]+ GiB is available"):
        Engine(config)
    with pytest.raises(ValueError, match=r"asks for 2048\.00 GiB of host memory and [0-9.]+ GiB is available"):
        allocate_cpu_pool(2**20, (2**20,), torch.float16, pinned=False)


DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU")])]


def busy_conversation(model_dir, device: str, num_gpu_blocks: int, num_cpu_blocks: int, params: SamplingParams,
                      load_bytes_per_s: float | None = None) -> tuple[dict[str, list[int]], dict[str, int], Engine]:
    """Turn 1, two fillers that evict it, then turn 2 arriving while a long request decodes
    (on CUDA its loads are planned ahead, during the decode steps, and paced meanwhile:
    `load_bytes_per_s` sets the rate, in chunks of a block)."""
    engine = Engine(WorkerConfig(model=str(model_dir), device=device, dtype="float32", max_num_seqs=4,
                                 num_gpu_blocks_override=num_gpu_blocks, num_cpu_blocks_override=num_cpu_blocks))
    engine.debug_invariants = True
    if load_bytes_per_s is not None:
        copier = engine.executor.kv_copier
        copier.pending_loads = PacedLoads(copier.block_bytes, load_bytes_per_s, engine.timing.load_burst_s)
        copier.pending_loads.chunk_blocks = 1
    tokens: dict[str, list[int]] = {}
    cached: dict[str, int] = {}

    def add(request_id: str, prompt: list[int], max_tokens: int) -> None:
        request_params = SamplingParams(**{**{f: getattr(params, f) for f in params.__struct_fields__},
                                           "max_tokens": max_tokens})
        assert engine.add_request(Generate(request_id=request_id, prompt_token_ids=prompt, block_hashes=[],
                                           params=request_params)) is None

    def step() -> None:
        for delta in engine.step():
            assert delta.error is None
            tokens.setdefault(delta.request_id, []).extend(delta.new_token_ids)
            if delta.num_cached_tokens >= 0:
                cached[delta.request_id] = delta.num_cached_tokens

    def finish() -> None:
        while engine.has_work:
            step()

    turn_1 = [(7 * i) % 90 + 1 for i in range(32)]
    add("turn-1", turn_1, 4)
    finish()
    add("filler-a", [(5 * i) % 90 + 2 for i in range(63)], 1)
    add("filler-b", [(11 * i) % 90 + 3 for i in range(63)], 1)
    finish()
    add("long", [(13 * i) % 90 + 4 for i in range(20)], 40)
    for _ in range(3):
        step()
    add("turn-2", turn_1 + tokens["turn-1"] + [3, 1, 4, 1, 5, 9, 2, 6, 5, 3], 4)
    finish()
    return tokens, cached, engine


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_loads_planned_beside_a_decoding_request_give_what_a_pool_that_kept_the_blocks_gives(
        model_dir, device, params):
    tokens, cached, engine = busy_conversation(model_dir, device, 6, 16, params)
    reference, reference_cached, _ = busy_conversation(model_dir, device, 64, 0, params)
    assert cached["turn-2"] == reference_cached["turn-2"] == 32
    stats = engine.stats()
    assert (stats.cached_tokens_gpu, stats.cached_tokens_cpu) == (0, 32)
    assert stats.kv_offload_bytes_cpu_to_gpu == 2 * engine.runner.kv_cache[0].nbytes
    assert tokens == reference


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_loads_paced_beside_a_decoding_request_land_once_nothing_else_computes(model_dir):
    """At a rate too low to move a second block, turn 2's loads wait while the long request
    decodes, then go at once when it is the only request left, waiting for them."""
    tokens, cached, engine = busy_conversation(model_dir, "cuda", 6, 16, GREEDY, load_bytes_per_s=1.0)
    reference, reference_cached, _ = busy_conversation(model_dir, "cuda", 64, 0, GREEDY)
    assert cached["turn-2"] == reference_cached["turn-2"] == 32
    assert engine.stats().cached_tokens_cpu == 32
    assert tokens == reference
    assert not engine.executor.kv_copier.pending_loads


def test_an_idle_engine_writes_its_cached_blocks_back_so_a_later_hit_loads_without_stores(model_dir):
    engine = engine_for(model_dir, num_cpu_blocks=16)
    turn_1 = [(7 * i) % 90 + 1 for i in range(32)]
    expected = run(engine_for(model_dir, num_cpu_blocks=16), "turn-1", turn_1, GREEDY)[0]
    assert run(engine, "turn-1", turn_1, GREEDY)[0] == expected
    manager = engine.block_manager
    assert manager.tier.num_used == 0  # nothing evicted yet
    batches = 0
    while engine.idle_write_back():
        batches += 1
    assert batches >= 1 and not engine.idle_write_back()
    assert manager.tier.num_used == manager.num_cached_blocks == 2  # turn 1's two full blocks
    stored = engine.executor.kv_copier.bytes_to_cpu
    run(engine, "filler", [(5 * i) % 90 + 2 for i in range(63)], GREEDY)  # evicts them: no store
    assert engine.executor.kv_copier.bytes_to_cpu == stored
    tokens, cached = run(engine, "again", turn_1, GREEDY)
    assert (tokens, cached) == (expected, 16 * 1)  # block 2 holds the last token: recomputed
    manager.check_invariants()


def test_an_idle_engine_writes_back_into_a_full_tier_so_a_later_hit_loads_without_stores(model_dir):
    """A long-running tier is full: write-back ahead then replaces its oldest CPU-only copies
    (those an eviction's store would replace), so evicting the blocks written back stores
    nothing."""
    engine = engine_for(model_dir, num_cpu_blocks=6)
    turn_1 = [(7 * i) % 90 + 1 for i in range(32)]
    expected = run(engine_for(model_dir, num_cpu_blocks=6), "turn-1", turn_1, GREEDY)[0]
    for k in range(4):  # eight blocks of history for a GPU pool of four and a tier of six
        run(engine, f"old-{k}", [(3 * i + k) % 90 + 3 for i in range(32)], GREEDY)
    assert run(engine, "turn-1", turn_1, GREEDY)[0] == expected
    manager = engine.block_manager
    gpu_cached = list(manager._lru)
    assert manager.tier.num_free == 0 and any(block.cpu_slot is None for block in gpu_cached)
    while engine.idle_write_back():
        pass
    assert all(block.cpu_slot is not None for block in gpu_cached)
    stored = engine.executor.kv_copier.bytes_to_cpu
    run(engine, "filler", [(5 * i) % 90 + 2 for i in range(63)], GREEDY)  # evicts them all: no store
    assert engine.executor.kv_copier.bytes_to_cpu == stored
    tokens, cached = run(engine, "again", turn_1, GREEDY)
    assert (tokens, cached) == (expected, 16 * 1)
    manager.check_invariants()


def test_the_busy_loop_hears_of_a_landed_load_before_the_next_step(model_dir):
    """A turn whose history is only in the tier waits for its load; the engine says when that
    load has landed (on the CPU the copies ran when queued), which ends the worker's intake."""
    engine = engine_for(model_dir, num_cpu_blocks=8)
    assert not engine.awaited_load_landed()  # nobody waits
    turn_1 = [(7 * i) % 90 + 1 for i in range(32)]
    tokens, _ = run(engine, "turn-1", turn_1, GREEDY)
    run(engine, "filler", [(5 * i) % 90 + 2 for i in range(63)], GREEDY)
    assert engine.add_request(Generate(request_id="turn-2", prompt_token_ids=turn_1 + tokens + [3, 1, 4],
                                       block_hashes=[], params=GREEDY)) is None
    engine.step()  # plans the load of turn 1's two blocks; nothing computes yet
    assert engine.scheduler.num_awaiting_load == 1 and engine.waits_for_loads
    assert engine.awaited_load_landed()
    engine.step()  # hears of the landing, computes the turn
    assert engine.scheduler.num_awaiting_load == 0 and not engine.awaited_load_landed()


def test_the_landing_estimate_waits_for_loads_still_to_be_queued(model_dir):
    """On the CPU copies run as they are queued: nothing is left to land. Loads not queued yet
    (paced) have no landing time; the engine never plans ahead of a landing here."""
    engine = engine_for(model_dir, num_cpu_blocks=8)
    copier = engine.executor.kv_copier
    assert copier.loads_land_in() == 0.0 and copier.load_speed() == copier.load_speed_guess
    conversation(engine, GREEDY)
    assert copier.loads_land_in() == 0.0 and not engine.tier.plan_before_landing()
    copier.pending_loads.add(((0, 1),), None, None, 0)
    assert copier.loads_land_in() is None
