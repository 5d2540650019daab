"""Tiny random checkpoints the engine tests load from disk."""

from __future__ import annotations

import torch

TINY_VOCAB = 384


def save_tiny_qwen3(path, *, vocab_size: int = TINY_VOCAB, seed: int = 0, hidden_size: int = 64,
                    num_layers: int = 2, num_heads: int = 4) -> str:
    """A small random Qwen3 (EOS 1, head_dim 16, half as many KV heads as query heads) saved in
    `path`, with large weights so its greedy outputs do not loop on one token; returns the folder."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                         num_hidden_layers=num_layers, num_attention_heads=num_heads,
                         num_key_value_heads=num_heads // 2, head_dim=16, max_position_embeddings=512,
                         tie_word_embeddings=False, eos_token_id=1)
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.3)
    model.save_pretrained(path)
    return str(path)
