"""A tensor-parallel rank loads its shard of a checkpoint without the whole model: built at the
shard's shapes, each tensor read as the rank's slice, and the parameters exactly those of
loading the whole model and then cutting it (`shard_model`).

Loading calls no collective, so one process plays both ranks of a group of two.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from spillway.protocol.local import model_files
from spillway.worker.runner.executor import load_model
from spillway.worker.models import build_model, loader
from spillway.worker.models.llama import LlamaForCausalLM
from spillway.worker.models.shard_loading import load_shard
from spillway.worker.models.spec import DecoderSpec
from spillway.worker.models.tensor_parallel import shard_model
from tiny_models import (save_tiny_deepseek_v2, save_tiny_deepseek_v3, save_tiny_llama_with_biases, save_tiny_mixtral,
                         save_tiny_qwen3, save_tiny_qwen3_moe)

CPU = torch.device("cpu")
WORLD_SIZE = 2
CHECKPOINTS = {
    "qwen3-split-kv-heads": lambda path: save_tiny_qwen3(path),  # 4 heads over 2 KV heads
    "qwen3-replicated-kv-head": lambda path: save_tiny_qwen3(path, num_kv_heads=1),
    # Every bias, one KV head, tied lm_head, vocabulary 301 (rank 1's slice has a padding row).
    "llama-biases-tied-odd-vocab": save_tiny_llama_with_biases,
    # A sparse and a dense layer; each expert's tensors apart, over several files.
    "qwen3-moe": save_tiny_qwen3_moe,
    "mixtral": save_tiny_mixtral,
    "deepseek-v2-latent-heads": save_tiny_deepseek_v2,  # MLA without a query LoRA, shared experts
    "deepseek-v3-query-lora": save_tiny_deepseek_v3,
}
# Each layer's experts in two tensors (transformers' names, a converted GGUF's): a rank reads
# more than its part of gate_up_proj (from its first gate row to its last up row).
STACKED = {"qwen3-moe-stacked-experts": lambda path: save_tiny_qwen3_moe(path, stacked=True)}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    return {name: save(tmp_path_factory.mktemp(name)) for name, save in {**CHECKPOINTS, **STACKED}.items()}


def resolve(folder: str):
    files = model_files.resolve_model(folder)
    return files, model_files.load_config(files)


def whole_then_shard(files, hf_config, rank: int, dtype: torch.dtype):
    model = build_model(hf_config, device=CPU, dtype=dtype)
    model.load_weights(loader.iter_weights(files))
    shard_model(model, rank, WORLD_SIZE)
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("checkpoint", {**CHECKPOINTS, **STACKED})
def test_each_rank_loads_exactly_the_parameters_of_whole_then_shard(checkpoints, checkpoint, dtype):
    files, hf_config = resolve(checkpoints[checkpoint])
    for rank in range(WORLD_SIZE):
        expected = dict(whole_then_shard(files, hf_config, rank, dtype).named_parameters(remove_duplicate=False))
        model = load_shard(hf_config, files, rank, WORLD_SIZE, device=CPU, dtype=dtype)
        loaded = dict(model.named_parameters(remove_duplicate=False))

        assert loaded.keys() == expected.keys()
        for name, param in loaded.items():
            assert param.dtype == dtype and param.shape == expected[name].shape, name
            assert torch.equal(param, expected[name]), f"rank {rank}: {name}"
        if hf_config.tie_word_embeddings:
            assert model.lm_head.linear.weight is model.model.embed_tokens.weight


def shard_elements(hf_config, rank: int) -> int:
    """What rank `rank` of 2 holds, from the config: a half of every split weight (each
    expert's too), all of the norms, of the routers and of a replicated KV head, the
    row-parallel biases on rank 0, half the vocabulary."""
    hidden = hf_config.hidden_size
    intermediate = hf_config.intermediate_size // WORLD_SIZE
    if getattr(hf_config, "kv_lora_rank", None):
        layer = mla_attention_elements(hf_config) + 2 * hidden
    else:
        head_dim = getattr(hf_config, "head_dim", None) or hidden // hf_config.num_attention_heads
        q_rows = hf_config.num_attention_heads // WORLD_SIZE * head_dim
        kv_rows = max(hf_config.num_key_value_heads // WORLD_SIZE, 1) * head_dim
        layer = hidden * (q_rows + 2 * kv_rows) + q_rows * hidden + 2 * hidden  # q/k/v, o_proj, the two norms
    if hf_config.model_type in ("qwen3", "qwen3_moe"):
        layer += 2 * head_dim  # q_norm, k_norm
    if getattr(hf_config, "attention_bias", False):
        layer += q_rows + 2 * kv_rows + (hidden if rank == 0 else 0)
    if getattr(hf_config, "mlp_bias", False):
        layer += 2 * intermediate + (hidden if rank == 0 else 0)
    moe = DecoderSpec.from_config(hf_config).moe
    feed_forward = 0
    for index in range(hf_config.num_hidden_layers):
        if moe is not None and moe.is_sparse(index):  # the router, then gate/up and down of each expert
            feed_forward += moe.num_experts * hidden * (1 + 3 * moe.expert_intermediate_size // WORLD_SIZE)
            feed_forward += 3 * hidden * (moe.shared_expert_intermediate_size or 0) // WORLD_SIZE
            feed_forward += moe.num_experts if moe.correction_bias else 0
        else:
            feed_forward += 3 * hidden * intermediate  # gate/up, down_proj
    vocab_tables = 1 if hf_config.tie_word_embeddings else 2
    vocab_rows = -(-hf_config.vocab_size // WORLD_SIZE)
    return hf_config.num_hidden_layers * layer + feed_forward + hidden + vocab_tables * vocab_rows * hidden


def mla_attention_elements(hf_config) -> int:
    """A rank's latent attention: its query heads' rows of the query projection (after the
    whole query LoRA) and of kv_b_proj, their columns of o_proj; the latent projection and
    norms whole."""
    hidden, heads = hf_config.hidden_size, hf_config.num_attention_heads // WORLD_SIZE
    latent, lora = hf_config.kv_lora_rank, hf_config.q_lora_rank
    query_heads = heads * (hf_config.qk_nope_head_dim + hf_config.qk_rope_head_dim)
    query = hidden * query_heads if lora is None else hidden * lora + lora + lora * query_heads
    latent_row = hidden * (latent + hf_config.qk_rope_head_dim) + latent
    up = heads * (hf_config.qk_nope_head_dim + hf_config.v_head_dim) * latent
    return query + latent_row + up + heads * hf_config.v_head_dim * hidden


@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
def test_a_rank_builds_and_reads_its_shard_only(checkpoints, checkpoint, monkeypatch):
    """Through the worker's `load_model`: the model gets storage at the shard's shapes, and
    every tensor read from the checkpoint is a slice (the padding rows are not read)."""
    files, hf_config = resolve(checkpoints[checkpoint])
    built, read = [], []
    original_build, original_iter_weights = LlamaForCausalLM.build.__func__, loader.iter_weights

    def build(cls, *args, **kwargs):
        model = original_build(cls, *args, **kwargs)
        built.append(sum(param.numel() for param in model.parameters()))
        return model

    def iter_weights(*args, **kwargs):
        for name, tensor in original_iter_weights(*args, **kwargs):
            read.append(tensor.numel())
            yield name, tensor

    monkeypatch.setattr(LlamaForCausalLM, "build", classmethod(build))
    monkeypatch.setattr(loader, "iter_weights", iter_weights)
    whole = sum(tensor.numel() for _, tensor in original_iter_weights(files))
    for rank in range(WORLD_SIZE):
        built.clear()
        read.clear()
        load_model(hf_config, files, device=CPU, dtype=torch.float32, seed=0, shard=(rank, WORLD_SIZE))
        padding = rank * (-(-hf_config.vocab_size // WORLD_SIZE) * WORLD_SIZE - hf_config.vocab_size)
        vocab_tables = 1 if hf_config.tie_word_embeddings else 2

        assert built == [shard_elements(hf_config, rank)]
        assert sum(read) == built[0] - vocab_tables * padding * hf_config.hidden_size
        assert sum(read) < 0.6 * whole


def test_a_checkpoint_that_does_not_match_the_config_is_refused_before_it_is_cut(checkpoints, tmp_path):
    """Its gate/up rows would cut cleanly into a wrong shard: the whole tensor's shape is checked."""
    folder = shutil.copytree(checkpoints["qwen3-split-kv-heads"], tmp_path / "wrong-config")
    config = json.loads((folder / "config.json").read_text())
    config["intermediate_size"] //= 2
    (folder / "config.json").write_text(json.dumps(config))
    files, hf_config = resolve(str(folder))

    with pytest.raises(ValueError, match=r"weight model\.layers\.\d\.mlp\.\w+_proj\.weight has shape"):
        load_shard(hf_config, files, 1, WORLD_SIZE, device=CPU, dtype=torch.float32)


@pytest.mark.parametrize(("checkpoint", "refused"), [
    ("qwen3-moe", r"model\.layers\.\d\.mlp\.experts\.\d\.\w+_proj\.weight"),
    ("qwen3-moe-stacked-experts", r"model\.layers\.\d\.mlp\.experts\.\w+_proj"),
])
def test_experts_that_do_not_match_the_config_are_refused_before_they_are_cut(checkpoints, tmp_path, checkpoint,
                                                                                refused):
    folder = shutil.copytree(checkpoints[checkpoint], tmp_path / "wrong-config")
    config = json.loads((folder / "config.json").read_text())
    config["moe_intermediate_size"] //= 2
    (folder / "config.json").write_text(json.dumps(config))
    files, hf_config = resolve(str(folder))

    with pytest.raises(ValueError, match=rf"weight {refused} has shape"):
        load_shard(hf_config, files, 1, WORLD_SIZE, device=CPU, dtype=torch.float32)
