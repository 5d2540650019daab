"""Built-in model configs (dummy weights) and the dummy weights themselves."""

from __future__ import annotations

import math

import pytest
import torch

from spillway.protocol.local import model_files
from spillway.protocol.local.model_files import TokenizerNotFoundError, load_config, load_tokenizer, resolve_model
from spillway.worker.models.loader import init_dummy_weights, iter_weights
from spillway.worker.models.spec import DecoderSpec, MoeSpec


@pytest.fixture(autouse=True)
def own_cache_dir(tmp_path, monkeypatch):
    """Every test here writes to a private cache, never to the user's."""
    path = tmp_path / "cache"
    monkeypatch.setenv("SPILLWAY_CACHE_DIR", str(path))
    return path


@pytest.mark.parametrize(
    ("name", "model_type", "hidden", "layers", "heads", "kv_heads", "head_dim", "ffn", "vocab"),
    [
        ("qwen3-8b", "qwen3", 4096, 36, 32, 8, 128, 12288, 151936),
        ("qwen3-32b", "qwen3", 5120, 64, 64, 8, 128, 25600, 151936),
        ("qwen3-0.6b", "qwen3", 1024, 28, 16, 8, 128, 3072, 151936),
        ("qwen3-30b-a3b", "qwen3_moe", 2048, 48, 32, 4, 128, 6144, 151936),
        ("llama-3-8b", "llama", 4096, 32, 32, 8, 128, 14336, 128256),
        pytest.param(
            "smollm2-135m", "llama", 576, 30, 9, 3, 64, 1536, 49152, marks=pytest.mark.slow
        ),
    ],
)
def test_builtin_configs_give_real_dummy_configs(
    name, model_type, hidden, layers, heads, kv_heads, head_dim, ffn, vocab
):
    files = resolve_model(name, load_format="dummy")
    assert (files.name, files.load_format) == (name, "dummy")
    config = load_config(files)
    head_dim_of_config = config.head_dim or config.hidden_size // config.num_attention_heads
    assert (
        config.model_type, config.hidden_size, config.num_hidden_layers, config.num_attention_heads,
        config.num_key_value_heads, head_dim_of_config, config.intermediate_size, config.vocab_size,
    ) == (model_type, hidden, layers, heads, kv_heads, head_dim, ffn, vocab)
    with pytest.raises(ValueError, match="no weights"):
        next(iter_weights(files))


@pytest.mark.parametrize("name", ["qwen3-8b", "qwen3-32b", "qwen3-0.6b", "qwen3-30b-a3b", "llama-3-8b",
                                  "deepseek-v2-lite"])
def test_builtin_configs_without_tokenizer_say_so(name):
    files = resolve_model(name, load_format="dummy")
    assert [p.name for p in files.path.iterdir()] == ["config.json"]
    with pytest.raises(TokenizerNotFoundError, match="token ids only"):
        load_tokenizer(files)


def test_builtin_qwen3_30b_a3b_is_a_mixture_of_experts_in_every_layer():
    spec = DecoderSpec.from_config(load_config(resolve_model("qwen3-30b-a3b", load_format="dummy")))
    assert spec.moe == MoeSpec(num_experts=128, top_k=8, expert_intermediate_size=768, norm_topk_prob=True,
                               sparse_layers=tuple(range(48)), weights_in_logits_dtype=True)
    assert (spec.qk_norm, spec.sliding_window, spec.tie_word_embeddings, spec.rope_theta, spec.rms_norm_eps) == (
        True, None, False, 1e6, 1e-6)


def test_builtin_folder_follows_a_changed_config(own_cache_dir, tmp_path, monkeypatch):
    configs = tmp_path / "configs"
    configs.mkdir()
    (configs / "tiny.json").write_text('{"model_type": "llama", "hidden_size": 64}')
    monkeypatch.setattr(model_files, "BUILTIN_CONFIGS_DIR", configs)
    files = resolve_model("tiny", load_format="dummy")
    (configs / "tiny.json").write_text('{"model_type": "llama", "hidden_size": 128}')
    assert resolve_model("tiny", load_format="dummy").path == files.path
    assert load_config(files).hidden_size == 128


def test_init_dummy_weights_gives_finite_varied_logits():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig.from_json_file(model_files.BUILTIN_CONFIGS_DIR / "smollm2-135m.json")
    model = LlamaForCausalLM(config).eval()
    init_dummy_weights(model, seed=0)
    params = dict(model.named_parameters())
    assert torch.equal(params["model.layers.3.input_layernorm.weight"], torch.ones(576))
    assert torch.equal(params["model.norm.weight"], torch.ones(576))
    q_proj = params["model.layers.0.self_attn.q_proj.weight"]
    assert 0.019 < q_proj.std().item() < 0.021
    assert all(torch.isfinite(p).all() for p in params.values())
    with torch.no_grad():
        logits = model(torch.tensor([[1, 19556, 28, 905]])).logits
    assert torch.isfinite(logits).all()
    assert (logits.std(dim=-1) > 0.1).all()
    assert len(set(logits[0].argmax(dim=-1).tolist())) > 1

    embedding = params["model.embed_tokens.weight"].clone()
    init_dummy_weights(model, seed=1)
    assert not torch.equal(params["model.embed_tokens.weight"], embedding)
    init_dummy_weights(model, seed=0)
    assert torch.equal(params["model.embed_tokens.weight"], embedding)


def test_init_dummy_weights_zeroes_biases_and_sets_qk_norms():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=256, attention_bias=True,
    )
    model = Qwen3ForCausalLM(config)
    init_dummy_weights(model)
    params = dict(model.named_parameters())
    assert torch.equal(params["model.layers.1.self_attn.q_norm.weight"], torch.ones(16))
    assert torch.equal(params["model.layers.1.self_attn.k_proj.bias"], torch.zeros(32))
    assert params["lm_head.weight"].abs().max() > 0


def test_builtin_deepseek_v2_lite_is_latent_attention_over_experts_with_yarn():
    from spillway.worker.models.rope_scaling import YarnRopeScaling
    from spillway.worker.models.spec import kv_cache_row

    config = load_config(resolve_model("deepseek-v2-lite", load_format="dummy"))
    spec = DecoderSpec.from_config(config)
    assert kv_cache_row(config) == (1, 1, 576)  # 512 latent + 64 rotary values a token and layer
    assert (spec.mla.q_lora_rank, spec.mla.kv_lora_rank, spec.mla.v_head_dim) == (None, 512, 128)
    assert (spec.moe.num_experts, spec.moe.top_k, spec.moe.expert_intermediate_size) == (64, 6, 1408)
    assert spec.moe.sparse_layers == tuple(range(1, 27))  # layer 0 is dense
    assert spec.moe.shared_expert_intermediate_size == 2 * 1408
    assert isinstance(spec.rope_scaling, YarnRopeScaling) and spec.rope_scaling.factor == 40
    assert spec.mla.softmax_scale == pytest.approx(192**-0.5 * (0.1 * 0.707 * math.log(40) + 1) ** 2)
