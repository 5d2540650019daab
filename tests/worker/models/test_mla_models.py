"""DeepSeek V2 and V3 (multi-head latent attention) against Hugging Face transformers: tiny
random models saved with `save_pretrained` and read back through the loader, run batched with
chunked prefill over the latent KV cache; logits within 1e-4 in float32, greedy tokens equal.
Also: the cache's one latent row a token, and what is refused (CUDA, YaRN, tensor parallelism)."""

from __future__ import annotations

import pytest
import torch
import transformers
from tiny_models import tiny_deepseek_v2, tiny_deepseek_v3

from spillway.gateway import LLM, SamplingParams
from spillway.worker.models import build_model
from spillway.worker.models.mla import MlaAttention
from spillway.worker.models.sparse_moe import SparseMoeBlock
from spillway.worker.models.spec import DecoderSpec, mla_softmax_scale
from spillway.worker.models.tensor_parallel import ShardLayout
from spillway.worker.runner.kv_blocks import kv_block_bytes
from spillway.worker.runner.model_runner import ChunkInput, ModelRunner
from tests.worker.models.test_moe_models import (
    BLOCK_SIZE,
    CPU,
    TOLERANCE,
    chunked_greedy,
    hf_greedy,
    hf_logits,
    load,
    random_prompts,
)

FAMILIES = {"deepseek_v2": tiny_deepseek_v2, "deepseek_v3": tiny_deepseek_v3}


@pytest.fixture(scope="module", params=FAMILIES)
def saved(request, tmp_path_factory):
    """(folder written by `save_pretrained`, the transformers model)."""
    hf = FAMILIES[request.param]()
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return path, hf


def test_chunked_batched_prefill_and_decode_match_hf(saved):
    path, hf = saved
    runner = ModelRunner(load(path), num_blocks=80, block_size=BLOCK_SIZE, device=CPU, dtype=torch.float32)
    prompts = random_prompts((3, 11, 18, 26), hf.config.vocab_size)
    new_tokens = 6

    sequences, sampled = chunked_greedy(runner, prompts, budget=10, new_tokens=new_tokens)

    for prompt, sequence, logits_at in zip(prompts, sequences, sampled):
        reference = hf_logits(hf, sequence)
        assert sorted(logits_at) == list(range(len(prompt) - 1, len(sequence) - 1))
        for position, logits in logits_at.items():
            assert (logits - reference[position]).abs().max().item() < TOLERANCE, position
        assert sequence[len(prompt):] == hf_greedy(hf, prompt, new_tokens)


def test_the_engine_generates_hf_greedy_tokens_with_chunked_prefill(saved):
    """Through the worker (its CPU linears packed for oneDNN, `kv_b_proj` left as it is)."""
    path, hf = saved
    prompts = random_prompts((5, 23, 40, 9), hf.config.vocab_size, seed=1)
    with LLM(str(path), device="cpu", dtype="float32", max_num_batched_tokens=16, max_model_len=128,
             enable_prefix_caching=False) as llm:
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)

    assert [out.outputs[0].token_ids for out in outputs] == [hf_greedy(hf, p, 8) for p in prompts]


def test_the_cache_holds_each_token_s_normed_latent_and_rotated_key_in_one_row(saved):
    """One side, one head of kv_lora_rank + qk_rope_head_dim values; the first kv_lora_rank of
    a token's row in layer l are transformers' cached (normed) latent of that layer."""
    path, hf = saved
    config = hf.config
    runner = ModelRunner(load(path), num_blocks=8, block_size=BLOCK_SIZE, device=CPU, dtype=torch.float32)
    prompt = random_prompts((7,), config.vocab_size, seed=4)[0]
    runner.execute([ChunkInput(prompt, 0, [5, 2])])
    with torch.no_grad():
        hf_cache = hf(torch.tensor([prompt]), use_cache=True).past_key_values

    row = config.kv_lora_rank + config.qk_rope_head_dim
    assert runner.kv_cache.shape == (8, config.num_hidden_layers, 1, BLOCK_SIZE, 1, row)
    assert runner.kv_block_bytes == config.num_hidden_layers * BLOCK_SIZE * row * 4
    assert runner.kv_block_bytes == kv_block_bytes(config, BLOCK_SIZE, torch.float32)
    for layer in range(config.num_hidden_layers):
        rows = torch.cat((runner.kv_cache[5, layer, 0, :, 0], runner.kv_cache[2, layer, 0, :3, 0]))
        latent = hf_cache.layers[layer].keys[0, 0]
        assert (rows[:, : config.kv_lora_rank] - latent).abs().max().item() < 1e-5, layer


def test_attention_is_latent_and_the_layers_follow_the_config(saved):
    path, hf = saved
    model = load(path)
    assert all(isinstance(layer.self_attn, MlaAttention) for layer in model.model.layers)
    sparse = [isinstance(layer.mlp, SparseMoeBlock) for layer in model.model.layers]
    assert sparse == [False, True, True] == [hasattr(layer.mlp, "experts") for layer in hf.model.layers]
    assert all(layer.mlp.shared_experts is not None for layer in model.model.layers[1:])
    has_q_lora = hf.config.q_lora_rank is not None
    assert hasattr(model.model.layers[0].self_attn, "q_a_proj") == has_q_lora
    assert hasattr(model.model.layers[0].self_attn, "q_proj") == (not has_q_lora)


def test_transformers_in_memory_names_load_too(saved):
    """transformers 5 holds the experts stacked under our own names: its state dict loads, and
    gives the weights of the checkpoint, correction bias included."""
    path, hf = saved
    model = build_model(hf.config, device=CPU, dtype=torch.float32)
    model.load_weights(hf.state_dict().items())
    from_disk = dict(load(path).checkpoint_weights())
    assert from_disk.keys() == dict(model.checkpoint_weights()).keys()
    for name, tensor in model.checkpoint_weights():
        assert torch.equal(tensor, from_disk[name]), name
    assert ("model.layers.1.mlp.gate.e_score_correction_bias" in from_disk) == (hf.config.model_type == "deepseek_v3")


def test_a_multi_token_prediction_layer_after_the_decoder_is_skipped():
    """DeepSeek V3 checkpoints hold one more layer (multi-token prediction), not served."""
    hf = tiny_deepseek_v3(num_layers=2)
    state = dict(hf.state_dict())
    extra = {name.replace("layers.1.", "layers.2."): tensor for name, tensor in state.items() if ".layers.1." in name}
    model = build_model(hf.config, device=CPU, dtype=torch.float32)
    model.load_weights([*state.items(), *extra.items()])

    prompt = random_prompts((9,), hf.config.vocab_size, seed=5)[0]
    runner = ModelRunner(model, num_blocks=8, block_size=BLOCK_SIZE, device=CPU, dtype=torch.float32)
    logits = runner.execute([ChunkInput(prompt, 0, [0, 1, 2])])
    assert (logits[0] - hf_logits(hf, prompt)[-1]).abs().max().item() < TOLERANCE


@pytest.mark.parametrize("family", ["deepseek_v3_halves", "deepseek_v2_greedy"])
def test_the_other_rotary_layout_and_router_match_hf(family):
    """DeepSeek V3 without `rope_interleave` (rotary halves); DeepSeek V2's "greedy" router
    (every expert one group) with a query LoRA."""
    if family == "deepseek_v3_halves":
        hf = tiny_deepseek_v3(rope_interleave=False, num_layers=2)
    else:
        hf = tiny_deepseek_v2(topk_method="greedy", n_group=None, topk_group=None, q_lora_rank=24, num_layers=2)
    model = build_model(hf.config, device=CPU, dtype=torch.float32)
    model.load_weights(hf.state_dict().items())
    runner = ModelRunner(model, num_blocks=16, block_size=BLOCK_SIZE, device=CPU, dtype=torch.float32)
    prompts = random_prompts((13, 6), hf.config.vocab_size, seed=6)

    logits = runner.execute([ChunkInput(prompts[0], 0, [0, 1, 2, 3]), ChunkInput(prompts[1], 0, [9, 8])])

    for row, prompt in enumerate(prompts):
        assert (logits[row] - hf_logits(hf, prompt)[-1]).abs().max().item() < TOLERANCE


@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3"])
def test_yarn_rope_scaling_matches_hf_past_the_original_length(family):
    """YaRN as the released checkpoints use it, on 8 original positions (factor 4): its
    frequencies and attention factor in the rotary embedding, `mscale_all_dim` in the softmax
    scale; mscale and mscale_all_dim differ, so the attention factor is not 1."""
    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 8,
            "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.707}
    hf = FAMILIES[family](num_layers=2, rope_parameters=yarn, max_position_embeddings=32)
    assert hf.config.rope_parameters["rope_type"] == "yarn"
    model = build_model(hf.config, device=CPU, dtype=torch.float32)
    model.load_weights(hf.state_dict().items())
    runner = ModelRunner(model, num_blocks=80, block_size=BLOCK_SIZE, device=CPU, dtype=torch.float32)
    prompts = random_prompts((21, 5), hf.config.vocab_size, seed=7)

    sequences, sampled = chunked_greedy(runner, prompts, budget=9, new_tokens=4)

    for prompt, sequence, logits_at in zip(prompts, sequences, sampled):
        reference = hf_logits(hf, sequence)
        for position, logits in logits_at.items():
            assert (logits - reference[position]).abs().max().item() < TOLERANCE, position
        assert sequence[len(prompt):] == hf_greedy(hf, prompt, 4)


def test_an_mla_model_refuses_a_rope_type_it_does_not_use():
    config = transformers.DeepseekV3Config(num_hidden_layers=2, rope_parameters={
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 4096})
    with pytest.raises(ValueError, match="unsupported rope type 'llama3' for an MLA model; supported: default, yarn"):
        DecoderSpec.from_config(config)


def test_the_softmax_scale_folds_yarn_s_mscale_as_transformers_does():
    from transformers.modeling_rope_utils import yarn_apply_mscale

    yarn = {"rope_type": "yarn", "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 0.707}
    for params in (yarn, {**yarn, "mscale_all_dim": 0}, {"rope_type": "default"}):
        assert mla_softmax_scale(192, params) == pytest.approx(yarn_apply_mscale(params, 192**-0.5), rel=1e-12)
    assert mla_softmax_scale(192, yarn) > 192**-0.5 * 1.5  # mscale 1.26, squared


def test_a_rank_of_an_mla_model_holds_its_query_heads_and_the_whole_latent_head():
    spec = DecoderSpec.from_config(tiny_deepseek_v2(num_layers=1).config)
    layouts = [ShardLayout.plan(spec, rank, 2) for rank in range(2)]
    assert [(layout.first_head, layout.num_heads) for layout in layouts] == [(0, 2), (2, 2)]
    assert [(layout.first_kv_head, layout.num_kv_heads) for layout in layouts] == [(0, 1), (0, 1)]
    with pytest.raises(ValueError, match="tensor parallel size 3 does not divide the model's 4 attention heads"):
        ShardLayout.plan(spec, 0, 3)


def test_the_pool_is_sized_from_the_latent_row():
    """DeepSeek V3's 61 layers: 512 + 64 values a token and layer, one side; a dense model's
    bytes are unchanged (2 sides of every KV head)."""
    deepseek = transformers.DeepseekV3Config()
    assert kv_block_bytes(deepseek, 16, torch.bfloat16) == 61 * 16 * (512 + 64) * 2
    lite = transformers.DeepseekV2Config(num_hidden_layers=27, kv_lora_rank=512, qk_rope_head_dim=64, q_lora_rank=None)
    assert kv_block_bytes(lite, 16, torch.bfloat16) == 27 * 16 * 576 * 2
    qwen = transformers.Qwen3Config(num_hidden_layers=3, num_key_value_heads=2, head_dim=32)
    assert kv_block_bytes(qwen, 16, torch.bfloat16) == 3 * 2 * 16 * 2 * 32 * 2
