"""Tiny random checkpoints the engine tests load from disk."""

from __future__ import annotations

import torch

TINY_VOCAB = 384


def save_tiny_qwen3(path) -> str:
    """A 2-layer random Qwen3 (vocabulary 384, EOS 1) saved in `path`, with large weights so its
    greedy outputs do not loop on one token; returns the folder."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                         tie_word_embeddings=False, eos_token_id=1)
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.3)
    model.save_pretrained(path)
    return str(path)
