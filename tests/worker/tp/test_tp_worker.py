"""A tensor-parallel worker on the CPU: two gloo ranks (the worker and one `tp_rank` process).

`LLM(tensor_parallel_size=2)` generates, token for token, what one process generates; sizes the
model cannot split are refused before any worker starts; each rank sizes its pool from its own
KV heads; the step broadcast delivers rank 0's steps and fed tokens unchanged.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from spillway.gateway import LLM, SamplingParams
from spillway.protocol.local import model_files
from spillway.worker.runner.executor import Executor, PackedStep
from spillway.worker.runner.model_runner import ChunkInput
from spillway.worker.models import build_model
from spillway.worker.models.tensor_parallel import shard_model
from spillway.worker.core.step_plan import KVCopies
from spillway.worker.tp.channel import RankChannel
from tiny_models import (save_tiny_deepseek_v3, save_tiny_llama_with_biases, save_tiny_mixtral, save_tiny_qwen3,
                         save_tiny_qwen3_moe)

CPU = torch.device("cpu")
# Prompts of several lengths, one past the step budget (so later steps mix its prefill chunk
# with the others' decodes), and one sampled request: the seeded sampler runs on rank 0 only.
PROMPTS = [[5, 6, 7, 8, 9], list(range(10, 70)), [3], list(range(100, 121))]


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory) -> str:
    return save_tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3"))


def generate(model: str, tensor_parallel_size: int, **settings) -> list[list[int]]:
    # No block override: each rank sizes its pool, and the group takes the smallest (all_reduce MIN).
    llm = LLM(model=model, tensor_parallel_size=tensor_parallel_size, device="cpu", max_model_len=256,
              max_num_seqs=8, max_num_batched_tokens=32, **settings)
    try:
        greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        sampled = SamplingParams(temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], [greedy] * 3 + [sampled])
        return [list(output.outputs[0].token_ids) for output in outputs]
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def tiny_llama_with_biases(tmp_path_factory) -> str:
    return save_tiny_llama_with_biases(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def tiny_qwen3_moe(tmp_path_factory) -> str:
    return save_tiny_qwen3_moe(tmp_path_factory.mktemp("tiny-qwen3-moe"))


@pytest.fixture(scope="module")
def tiny_mixtral(tmp_path_factory) -> str:
    return save_tiny_mixtral(tmp_path_factory.mktemp("tiny-mixtral"))


@pytest.fixture(scope="module")
def tiny_deepseek_v3(tmp_path_factory) -> str:
    return save_tiny_deepseek_v3(tmp_path_factory.mktemp("tiny-deepseek-v3"))


# Each rank loads its slices of the checkpoint (worker/models/shard_loading.py): KV heads split
# (Qwen3), or one replicated with every bias, a tied lm_head and a padded vocabulary (Llama);
# each expert's slice of its width (Qwen3-MoE, with a dense layer; Mixtral); DeepSeek V3's query
# heads of its latent attention, the latent whole on each rank, and its shared expert's slice.
@pytest.mark.parametrize("checkpoint", ["tiny_qwen3", "tiny_llama_with_biases", "tiny_qwen3_moe", "tiny_mixtral",
                                        "tiny_deepseek_v3"])
def test_two_ranks_generate_what_one_process_does(request, checkpoint):
    model = request.getfixturevalue(checkpoint)
    alone = generate(model, 1)
    assert generate(model, 2) == alone
    assert all(len(tokens) == 12 for tokens in alone) and len({tuple(t) for t in alone}) == len(PROMPTS)


@pytest.mark.parametrize("model, size, numbers", [
    (None, 2, "the model's 3 KV heads"),  # SmolLM2-135M: 9 heads, 3 KV heads
    ("tiny", 3, "3 does not divide the model's 4 attention heads; 3 and the model's 2 KV heads"),
])
def test_sizes_the_model_cannot_split_are_refused(tiny_qwen3, model, size, numbers):
    with pytest.raises(ValueError) as refused:
        LLM(model=tiny_qwen3 if model == "tiny" else model, load_format="dummy" if model is None else "auto",
            tensor_parallel_size=size, device="cpu")
    assert f"LLM(tensor_parallel_size={size}): " in str(refused.value) and numbers in str(refused.value)


def tiered_conversation(model: str, size: int) -> tuple[list[list[int]], int, object]:
    """Two turns with a filler between them that takes the whole GPU pool (4 blocks of 16), so
    the first turn's blocks go to the CPU tier and come back for the second: (each request's
    tokens, the second turn's cached tokens, the stats)."""
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    block_bytes = 2 * 2 * 16 * 2 * 16 * 4  # layers, K and V, tokens, the model's 2 KV heads, head_dim, float32
    with LLM(model=model, tensor_parallel_size=size, device="cpu", max_model_len=64, max_num_seqs=4,
             num_gpu_blocks_override=4, cpu_offload_gb=8 * block_bytes / 2**30) as llm:
        def run(prompt: list[int]):
            return llm.generate([{"prompt_token_ids": prompt}], greedy, use_tqdm=False)[0]

        turn_1 = [(7 * i) % 200 + 2 for i in range(32)]
        first = run(turn_1)
        filler = run([(5 * i) % 200 + 3 for i in range(60)])
        second = run(turn_1 + list(first.outputs[0].token_ids) + [3, 1, 4, 1, 5, 9, 2, 6, 5, 3])
        tokens = [list(out.outputs[0].token_ids) for out in (first, filler, second)]
        return tokens, second.num_cached_tokens, llm.stats()


def test_two_ranks_with_a_cpu_tier_store_and_load_each_its_heads_as_one_process_does(tiny_qwen3):
    """Each rank's tier holds its own heads of the same blocks: the first turn's two blocks go to
    both ranks' tiers and come back for the second turn, which generates what one process does."""
    alone, alone_cached, _ = tiered_conversation(tiny_qwen3, 1)
    tokens, cached, stats = tiered_conversation(tiny_qwen3, 2)
    assert tokens == alone and cached == alone_cached == 32
    assert stats.cached_tokens_cpu == 32 and stats.kv_offload_bytes_cpu_to_gpu > 0


def test_two_ranks_verify_a_draft_models_tokens_as_one_process_decodes_without(tiny_qwen3):
    """The draft (here the target itself, so that most drafts are accepted) runs on rank 0 alone;
    every rank runs each verify step. Exact: the tokens of plain decoding on one process."""
    speculative = {"method": "draft_model", "model": tiny_qwen3, "num_speculative_tokens": 3}
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    outputs, stats = {}, None
    for name, size, settings in (("plain", 1, {}), ("speculative", 2, {"speculative_config": speculative})):
        with LLM(model=tiny_qwen3, tensor_parallel_size=size, device="cpu", max_model_len=256, **settings) as llm:
            outputs[name] = [list(out.outputs[0].token_ids) for out in llm.generate(prompts, greedy, use_tqdm=False)]
            stats = llm.stats()
    assert outputs["speculative"] == outputs["plain"]
    assert stats.spec_num_accepted_tokens > stats.spec_num_drafts > 0


def test_a_rank_sizes_its_pool_from_its_own_kv_heads(tiny_qwen3):
    """On the CPU the pool's budget is fixed (1 GiB): a rank holding half the KV heads fits twice the blocks."""
    files = model_files.resolve_model(tiny_qwen3)
    config = model_files.load_config(files)
    whole = build_model(config, device=CPU, dtype=torch.float32)
    half = build_model(config, device=CPU, dtype=torch.float32)
    shard_model(half, 0, 2)  # rank 0 of 2's shapes (sharding itself calls no collective)
    blocks = [Executor(model, block_size=16, device=CPU, dtype=torch.float32, kv_cache_dtype=torch.float32,
                       max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256)
              .kv_pool_blocks(gpu_memory_utilization=0.9, with_graphs=False) for model in (whole, half)]
    assert json.load(open(files.path / "config.json"))["num_key_value_heads"] == 2
    assert blocks[1] == 2 * blocks[0] > 0


STEPS = [
    PackedStep([ChunkInput([1, 2, 3], 0, [0, 1]), ChunkInput([9], 4, [2])], [], [], [0, 1],
               KVCopies(gpu_to_cpu=((1, 2),)), [2, 3], 1),
    PackedStep([ChunkInput([0], 3, [0, 1]), ChunkInput([7, 8], 0, [3]), ChunkInput([0], 4, [2])],
               [0, 2], [2, 0], [0, 1, 2]),
]
FED = torch.tensor([11, 12, 13, 14])


def _broadcast_rank(rank: int, rendezvous: str, queue) -> None:
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=2)
    channel = RankChannel(CPU)
    try:
        if rank == 0:
            for step in STEPS:
                channel.send_step(step, FED if step.feed_rows else None)
            channel.stop()
            return
        received = []
        while True:
            step, fed = channel.receive()
            received.append((step, None if fed is None else fed.tolist()))
            if step is None:
                break
        queue.put(received)
    finally:
        dist.destroy_process_group()


def test_the_step_broadcast_delivers_each_step_its_fed_tokens_and_the_stop(tmp_path):
    context = mp.get_context("spawn")
    queue = context.Queue()
    mp.start_processes(_broadcast_rank, args=(f"file://{tmp_path}/rendezvous", queue), nprocs=2,
                       start_method="spawn")
    # The fed tokens travel up to the step's largest source row: [11, 12, 13] for sources [2, 0].
    assert queue.get(timeout=10) == [(STEPS[0], None), (STEPS[1], [11, 12, 13]), (None, None)]


def test_qwen3_dummy_weights_generate_the_same_on_two_ranks(tmp_path):
    """The built-in qwen3-0.6b config with dummy weights: each rank generates the whole model
    from the seed, then keeps its shard, so both sizes run the same model. Two of its 28 layers,
    every layer being generated and cut alike; its other shapes (the 151,936-token tied
    vocabulary included) as they are. The test builds the model three times (two ranks, then
    one process), each a third as long as the whole 0.6B."""
    config = json.loads((model_files.BUILTIN_CONFIGS_DIR / "qwen3-0.6b.json").read_text())
    config.update(num_hidden_layers=2, max_window_layers=2)
    (tmp_path / "config.json").write_text(json.dumps(config))

    def run(size: int) -> list[list[int]]:
        with LLM(model=str(tmp_path), load_format="dummy", tensor_parallel_size=size, device="cpu",
                 max_model_len=128, num_gpu_blocks_override=32, max_num_seqs=4) as llm:
            outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]],
                                   SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
            return [list(output.outputs[0].token_ids) for output in outputs]

    assert run(2) == run(1)


def test_two_ranks_run_fp8_weights_each_quantizing_its_own_rows(tiny_qwen3):
    """Not token for token what one process generates: a row-parallel projection's row scales come
    from the rank's columns (each rank's rows are finer), and the ranks' partial sums round apart.
    The greedy first tokens, decided by the prefill alone, agree; every request runs to its end."""
    alone = generate(tiny_qwen3, 1, quantization="fp8")
    ranks = generate(tiny_qwen3, 2, quantization="fp8")
    assert all(len(tokens) == 12 for tokens in alone + ranks)
    assert [tokens[0] for tokens in ranks[:3]] == [tokens[0] for tokens in alone[:3]]
    assert alone != generate(tiny_qwen3, 1)  # the FP8 weights did change what the model computes
