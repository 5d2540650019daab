"""What a KV block costs before a model is built: the bytes of one block of a Hugging Face
config's cache (`block_size` tokens' keys and values in every layer, all KV heads; an MLA
model's one latent row a token and layer), and how many fit a memory budget. The engine sizes
the CPU tier with them and the draft model its own pool; a built runner has its own
`ModelRunner.kv_block_bytes`, which counts a tensor-parallel rank's share of the heads."""

from __future__ import annotations

import math

import torch

from spillway.worker.models.spec import kv_cache_row


def kv_block_shape(config, block_size: int) -> tuple[int, int, int, int, int]:
    """One block of `config`'s cache: `[num_layers, kv_sides, block_size, kv_heads, head_dim]`
    (the runner's `kv_cache_shape` for the whole model)."""
    kv_sides, num_kv_heads, head_dim = kv_cache_row(config)
    return config.num_hidden_layers, kv_sides, block_size, num_kv_heads, head_dim


def kv_block_bytes(config, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one KV block: `block_size` tokens' keys and values (or latent rows) in every
    layer, in the cache's `dtype` (one byte each for float8)."""
    return math.prod(kv_block_shape(config, block_size)) * dtype.itemsize


def num_blocks_for_memory(config, block_size: int, dtype: torch.dtype, memory_bytes: int) -> int:
    """How many KV blocks of the cache's `dtype` fit in `memory_bytes`."""
    return max(0, int(memory_bytes) // kv_block_bytes(config, block_size, dtype))
