"""Tiny random checkpoints the engine tests load from disk."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

TINY_VOCAB = 384


class TinyCheckpoints:
    """Tiny checkpoints saved in folders under `folder` on first use, one per name
    (`savers[name](path)` returns the folder), so tests parametrized over models save each once."""

    def __init__(self, folder: Path, savers: dict[str, Callable[[Path], str]]) -> None:
        self.folder = folder
        self.savers = savers
        self.saved: dict[str, str] = {}

    def __getitem__(self, name: str) -> str:
        if name not in self.saved:
            self.saved[name] = str(self.savers[name](self.folder / name))
        return self.saved[name]


def save_tiny_qwen3(path, *, vocab_size: int = TINY_VOCAB, seed: int = 0, hidden_size: int = 64,
                    num_layers: int = 2, num_heads: int = 4, num_kv_heads: int | None = None) -> str:
    """A small random Qwen3 (EOS 1, head_dim 16, by default half as many KV heads as query
    heads) saved in `path`, with large weights so its greedy outputs do not loop on one token;
    returns the folder."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                         num_hidden_layers=num_layers, num_attention_heads=num_heads,
                         num_key_value_heads=num_kv_heads or num_heads // 2, head_dim=16,
                         max_position_embeddings=512, tie_word_embeddings=False, eos_token_id=1)
    return _save_random(Qwen3ForCausalLM(config), path)


def save_tiny_llama_with_biases(path, *, vocab_size: int = 301, seed: int = 0) -> str:
    """A small random Llama with every bias (q/k/v, o_proj, the MLP's), one KV head for 4 query
    heads, a tied lm_head and an odd vocabulary, saved in `path` over several safetensors files."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=512,
                         attention_bias=True, mlp_bias=True, tie_word_embeddings=True, eos_token_id=1)
    return _save_random(LlamaForCausalLM(config), path, max_shard_size="100KB")


def tiny_qwen3_moe(*, seed: int = 0, vocab_size: int = TINY_VOCAB, num_layers: int = 3,
                   mlp_only_layers: tuple[int, ...] = (1,), norm_topk_prob: bool = True, **overrides):
    """A small random Qwen3-MoE in float32 (6 experts of width 32, top 2; layer 1 a dense MLP
    of width 96 by default; q/k norms; EOS 1): every weight random, norm scales around 1."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(**{**dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_experts=6,
        num_experts_per_tok=2, norm_topk_prob=norm_topk_prob, mlp_only_layers=list(mlp_only_layers),
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=512, tie_word_embeddings=False, eos_token_id=1), **overrides})
    return _randomized(Qwen3MoeForCausalLM(config), seed)


def tiny_mixtral(*, seed: int = 0, vocab_size: int = TINY_VOCAB, num_layers: int = 2, **overrides):
    """A small random Mixtral in float32 (4 experts of width 48, top 2; EOS 1)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(**{**dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=False, eos_token_id=1), **overrides})
    return _randomized(MixtralForCausalLM(config), seed)


def tiny_deepseek_v2(*, seed: int = 0, vocab_size: int = TINY_VOCAB, num_layers: int = 3, **overrides):
    """A small random DeepSeek V2 in float32, shaped as V2-Lite: no query LoRA; layer 0 a dense
    MLP of width 96, the others 8 experts of width 32 (top 2, softmax scores, 4 groups of which
    2 are kept, scaled by 1.5) beside 2 shared experts; a latent row of 32 + 8 values, value
    heads (24) wider than the keys' non-rotary part (16); EOS 1."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    config = DeepseekV2Config(**{**dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8,
        num_experts_per_tok=2, n_shared_experts=2, first_k_dense_replace=1, n_group=4, topk_group=2,
        topk_method="group_limited_greedy", routed_scaling_factor=1.5, num_hidden_layers=num_layers,
        num_attention_heads=4, kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=24, max_position_embeddings=512, tie_word_embeddings=False, eos_token_id=1), **overrides})
    return _randomized(DeepseekV2ForCausalLM(config), seed)


def tiny_deepseek_v3(*, seed: int = 0, vocab_size: int = TINY_VOCAB, num_layers: int = 3, **overrides):
    """A small random DeepSeek V3 in float32: a query LoRA of rank 24; layer 0 a dense MLP of
    width 96, the others 8 experts of width 32 (top 2, sigmoid scores with a random correction
    bias, groups ranked by their top-2 sum, 2 of 4 kept, renormalised and scaled by 2.5) beside a
    shared expert; interleaved rotary pairs (`rope_interleave`); a latent row of 32 + 8 values;
    EOS 1."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(**{**dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8,
        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=4, topk_group=2,
        norm_topk_prob=True, routed_scaling_factor=2.5, num_hidden_layers=num_layers, num_attention_heads=4,
        kv_lora_rank=32, q_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24,
        rope_interleave=True, max_position_embeddings=512, tie_word_embeddings=False, eos_token_id=1), **overrides})
    model = _randomized(DeepseekV3ForCausalLM(config), seed)
    generator = torch.Generator().manual_seed(seed + 1)
    for name, buffer in model.named_buffers():
        if name.endswith("e_score_correction_bias"):  # a buffer, so `_randomized` left it zero
            buffer.copy_(torch.rand(buffer.shape, generator=generator) * 0.2)
    return model


def save_tiny_deepseek_v2(path) -> str:
    """`tiny_deepseek_v2()` saved in `path`."""
    tiny_deepseek_v2().save_pretrained(path)
    return str(path)


def save_tiny_deepseek_v3(path) -> str:
    """`tiny_deepseek_v3()` saved in `path`."""
    tiny_deepseek_v3().save_pretrained(path)
    return str(path)


def save_tiny_qwen3_moe(path, *, stacked: bool = False) -> str:
    """`tiny_qwen3_moe()` saved in `path` over several safetensors files (each expert's tensors
    apart, as `save_pretrained` writes them), or in one file under transformers' in-memory
    names (`stacked`: each layer's experts in two tensors, as a converted GGUF holds them)."""
    model = tiny_qwen3_moe()
    if not stacked:
        model.save_pretrained(path, max_shard_size="100KB")
        return str(path)
    from safetensors.torch import save_file

    model.config.save_pretrained(path)
    save_file({name: tensor.contiguous() for name, tensor in model.state_dict().items()},
              f"{path}/model.safetensors", metadata={"format": "pt"})
    return str(path)


def save_tiny_mixtral(path) -> str:
    """`tiny_mixtral()` saved in `path`."""
    tiny_mixtral().save_pretrained(path)
    return str(path)


def save_tiny_thinker(path, tokenizer, build_model) -> tuple[str, int, int]:
    """A random model over `tokenizer` with <think> and </think> added to it as single tokens:
    `build_model(vocab_size)` saved in `path` beside the tokenizer. Its lm_head row of
    </think> is zeroed: logit 0, below the largest of thousands of random logits, so greedy
    decoding never closes thinking by itself. Returns (folder, <think> id, </think> id)."""
    tokenizer.add_tokens(["<think>", "</think>"], special_tokens=False)
    think, end_think = tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    model = build_model(len(tokenizer))
    with torch.no_grad():
        model.lm_head.weight[end_think].zero_()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path), think, end_think


def _randomized(model, seed: int):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(torch.rand(param.shape, generator=generator) + 0.5)
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    return model.eval()


def _save_random(model, path, **save_options) -> str:
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.3)
    model.save_pretrained(path, **save_options)
    return str(path)
