"""Builders shared by the kernel tests: paged caches, block tables and the CPU/GPU marks."""

from __future__ import annotations

import pytest
import torch

from spillway.kernels.fp8 import cache_values

CPU = torch.device("cpu")


gpu = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    assert not torch.isnan(out).any(), "NaN in the output"
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def same_bytes(out: torch.Tensor, expected: torch.Tensor) -> bool:
    """Bit-for-bit equality: stricter than torch.equal, which takes -0.0 for 0.0."""
    return out.dtype == expected.dtype and torch.equal(out.view(torch.uint8), expected.view(torch.uint8))


def paged_kv(
    seq_lens: list[int],
    *,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    num_layers: int = 2,
    spare_blocks: int = 3,
    extra_table_width: int = 1,
    dtype: torch.dtype = torch.float32,
    device: torch.device = CPU,
    poison: bool = True,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A random cache and int32 block tables `[B, width]` giving each sequence its own shuffled blocks.

    Table entries past a sequence's blocks are 0 (a real block of another sequence, as the
    runner pads). With `poison`, every slot outside all contexts holds NaN, so a kernel that
    reads past a context (or a padded table entry) produces NaN.
    """
    generator = torch.Generator().manual_seed(seed)
    needed = [-(-n // block_size) for n in seq_lens]
    width = max(needed + [1]) + extra_table_width
    num_blocks = sum(needed) + spare_blocks
    shape = (num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim)
    cache = torch.randn(shape, generator=generator)
    order = torch.randperm(num_blocks, generator=generator)
    tables = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    valid = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    used = 0
    for seq, (seq_len, count) in enumerate(zip(seq_lens, needed)):
        blocks = order[used : used + count]
        used += count
        tables[seq, :count] = blocks.int()
        flat = torch.zeros(count * block_size, dtype=torch.bool)
        flat[:seq_len] = True
        valid[blocks] = flat.view(count, block_size)
    if poison:
        cache.masked_fill_(~valid[:, None, None, :, None, None], float("nan"))
    return cache.to(device=device, dtype=dtype), tables.to(device)


def random_tensor(*shape: int, dtype=torch.float32, device=CPU, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator).to(device=device, dtype=dtype)


def slot_mask(cache: torch.Tensor, layer: int, slots: torch.Tensor) -> torch.Tensor:
    """bool, shaped like `cache`: where the keys and values of `layer` at `slots` (the
    non-negative ones) live, in the layout of the cache's dtype (kernels/fp8.py)."""
    marks = torch.zeros(cache.shape, dtype=cache.dtype, device=cache.device)
    slots = slots[slots >= 0]
    blocks, offsets = slots // cache.shape[3], slots % cache.shape[3]
    one = torch.ones((), device=cache.device).to(cache.dtype)
    marks[blocks, layer, 0, offsets] = one
    cache_values(marks, layer)[blocks, offsets] = one
    return marks.float() != 0
