"""What a KV block costs before a model is built: the bytes of one block of a Hugging Face
config's cache (`block_size` tokens' keys and values in every layer, all KV heads), and how
many fit a memory budget. The engine sizes the CPU tier with them and the draft model its own
pool; a built runner has its own `ModelRunner.kv_block_bytes`, which counts a tensor-parallel
rank's share of the heads."""

from __future__ import annotations

import torch


def kv_dims(config) -> tuple[int, int, int]:
    num_heads = config.num_attention_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    return config.num_hidden_layers, num_kv_heads, head_dim


def kv_block_bytes(config, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one KV block: `block_size` tokens' keys and values in every layer, in the
    cache's `dtype` (one byte each for float8)."""
    num_layers, num_kv_heads, head_dim = kv_dims(config)
    return num_layers * 2 * block_size * num_kv_heads * head_dim * dtype.itemsize


def num_blocks_for_memory(config, block_size: int, dtype: torch.dtype, memory_bytes: int) -> int:
    """How many KV blocks of the cache's `dtype` fit in `memory_bytes`."""
    return max(0, int(memory_bytes) // kv_block_bytes(config, block_size, dtype))
