"""Builders shared by the kernel tests: paged caches, block tables and the CPU/GPU marks."""

from __future__ import annotations

import pytest
import torch

from spillway.kernels.fp8 import FP8_E4M3, cache_values, convert_cache

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
    cache_dtype: torch.dtype | None = None,
    device: torch.device = CPU,
    poison: bool = True,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A random cache and int32 block tables `[B, width]` giving each sequence its own shuffled blocks.

    The values are drawn in `dtype`, the cache is `cache_dtype` (default `dtype`; float8 e4m3
    as kernels/fp8.py lays it out). Table entries past a sequence's blocks are 0 (a real block
    of another sequence, as the runner pads). With `poison`, every slot outside all contexts
    holds NaN, so a kernel that reads past a context (or a padded table entry) produces NaN;
    except in a float8 cache, which never holds NaN (kernels/fp8.py): there the slots past a
    context in its last block hold 256, which a kernel that weighs them by more than 0 shows.
    """
    generator = torch.Generator().manual_seed(seed)
    needed = [-(-n // block_size) for n in seq_lens]
    width = max(needed + [1]) + extra_table_width
    num_blocks = sum(needed) + spare_blocks
    shape = (num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim)
    cache = torch.randn(shape, generator=generator).to(dtype)
    cache = convert_cache(cache, cache_dtype or dtype)
    order = torch.randperm(num_blocks, generator=generator)
    tables = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    valid = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    owned = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    used = 0
    for seq, (seq_len, count) in enumerate(zip(seq_lens, needed)):
        blocks = order[used : used + count]
        used += count
        tables[seq, :count] = blocks.int()
        flat = torch.zeros(count * block_size, dtype=torch.bool)
        flat[:seq_len] = True
        valid[blocks] = flat.view(count, block_size)
        owned[blocks] = True
    if poison:
        tails = owned & ~valid if cache.dtype == FP8_E4M3 else torch.zeros_like(owned)
        for layer in range(num_layers):
            for half in (cache[:, layer, 0], cache_values(cache, layer)):  # [blocks, slots, heads, dims]
                _fill(half, tails, 256.0)
                _fill(half, ~valid & ~tails, float("nan"))
    return cache.to(device), tables.to(device)


def _fill(half: torch.Tensor, slots: torch.Tensor, value: float) -> None:
    """Set `half`'s (a view `[blocks, slots, heads, dims]` of a cache) `slots` to `value`,
    through its bytes for a float8 cache (whose elementwise ops torch lacks on the CPU)."""
    mask = slots[:, :, None, None].expand(half.shape)
    if half.dtype == FP8_E4M3:
        byte = torch.tensor(value).to(FP8_E4M3).view(torch.uint8)
        half.view(torch.uint8).masked_fill_(mask, byte)
    else:
        half.masked_fill_(mask, value)


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
