"""write_kv against its reference: strided k/v views, padded slots, every block size; a float8
e4m3 cache holds exactly the reference's cast, out-of-range values saturated."""

import pytest
import torch
from kernel_testing import gpu, random_tensor, same_bytes, slot_mask

from spillway.kernels.fp8 import cache_values
from spillway.kernels.kv_write import write_kv, write_kv_reference

FP8 = torch.float8_e4m3fn


def _fused_kv(num_rows, num_heads, num_kv_heads, head_dim, dtype, device):
    """k and v as the strided views a fused qkv projection yields."""
    qkv = random_tensor(num_rows, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, device=device)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    k = qkv[:, q_size : q_size + kv_size].view(num_rows, num_kv_heads, head_dim)
    v = qkv[:, q_size + kv_size :].view(num_rows, num_kv_heads, head_dim)
    return k, v


def _check_write(slots, *, block_size, num_kv_heads, head_dim, layer, dtype=torch.float32, cache_dtype=None,
                 device="cpu", kv_scale=1.0):
    device = torch.device(device)
    num_blocks = max(slots) // block_size + 2
    cache = random_tensor(num_blocks, 3, 2, block_size, num_kv_heads, head_dim, dtype=cache_dtype or dtype,
                          device=device, seed=5)
    expected = cache.clone()
    k, v = _fused_kv(len(slots), 2 * num_kv_heads, num_kv_heads, head_dim, dtype, device)
    k, v = (k * kv_scale).to(dtype), (v * kv_scale).to(dtype)
    slot_mapping = torch.tensor(slots, dtype=torch.int64, device=device)
    write_kv(k, v, cache, layer, slot_mapping)
    write_kv_reference(k, v, expected, layer, slot_mapping)
    assert same_bytes(cache, expected)
    return cache, k, v


@pytest.mark.parametrize("block_size", [8, 16, 128])
def test_rows_land_in_their_slots_and_padding_is_skipped(block_size):
    slots = [0, block_size - 1, block_size, -1, 3 * block_size + 5, -1, 2 * block_size + 1]
    cache, k, v = _check_write(slots, block_size=block_size, num_kv_heads=3, head_dim=32, layer=1)
    last = 3 * block_size + 5
    assert torch.equal(cache[last // block_size, 1, 0, last % block_size], k[4])
    assert torch.equal(cache[last // block_size, 1, 1, last % block_size], v[4])


def test_other_layers_are_untouched():
    cache, _, _ = _check_write([5, 6, 7], block_size=16, num_kv_heads=1, head_dim=64, layer=2)
    fresh = random_tensor(*cache.shape, seed=5)
    assert torch.equal(cache[:, :2], fresh[:, :2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_float8_cache_holds_the_clamped_cast_and_padding_is_skipped(dtype):
    # Scaled by 2^-14 .. 2^9, k/v span e4m3's whole range: subnormals, rounding carries, beyond 448.
    slots = [0, 15, 16, -1, 53, -1, 33]
    spread = torch.exp2(torch.randint(-14, 10, (len(slots), 3, 32), generator=torch.Generator().manual_seed(2)))
    cache, k, v = _check_write(slots, block_size=16, num_kv_heads=3, head_dim=32, layer=1, dtype=dtype,
                               cache_dtype=FP8, kv_scale=spread)
    assert (k.abs() > 448).any() and (v.abs() > 448).any()
    assert not cache.float().isnan().any()
    stored_k = cache[53 // 16, 1, 0, 53 % 16].float()
    assert torch.equal(stored_k, k[4].float().clamp(-448, 448).to(FP8).float())
    assert stored_k.abs().max() == 448
    fresh = random_tensor(*cache.shape, seed=5).to(FP8)
    written = slot_mask(cache, 1, torch.tensor(slots))
    assert written.sum() == 2 * 5 * 3 * 32
    assert same_bytes(cache[~written], fresh[~written]), "wrote outside the slots (or for a padded row)"


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=gpu)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_float8_cache_never_holds_nan(dtype, device):
    """NaN keys and values are stored as 0, infinities as +-448: the attention kernels weigh a
    last block's slots past the context by 0 without zeroing them (kernels/fp8.py)."""
    scale = torch.ones(3, 2, 16)
    scale[0, 0, :4] = float("nan")
    scale[1, 1, 5] = float("inf")
    scale[2, :, 7] = float("nan")
    cache, k, v = _check_write([3, 4, 20], block_size=16, num_kv_heads=2, head_dim=16, layer=0, dtype=dtype,
                               cache_dtype=FP8, device=device, kv_scale=scale.to(device))
    assert k.isnan().any() and v.isnan().any() and v.isinf().any()
    cache = cache.cpu()
    assert not cache.float().isnan().any()
    assert torch.equal(cache_values(cache, 0)[0, 3, 0, :4].float(), torch.zeros(4))
    assert torch.equal(cache[0, 0, 0, 3, 0, :4].float(), torch.zeros(4))
    assert cache_values(cache, 0)[0, 4, 1, 5].float().abs() == 448
    assert torch.equal(cache_values(cache, 0)[1, 4, :, 7].float(), torch.zeros(2))


def test_float8_cache_stores_a_blocks_values_transposed():
    """[block, layer, 1] of a float8 cache is [kv_heads, head_dim, block_size]; keys are not."""
    slots = [16 + 5, 2 * 16 + 15]
    cache, k, v = _check_write(slots, block_size=16, num_kv_heads=3, head_dim=32, layer=1, cache_dtype=FP8)
    for row, slot in enumerate(slots):
        block, offset = divmod(slot, 16)
        values = cache[block, 1, 1].view(3, 32, 16)[:, :, offset]  # [heads, dims] of this token
        assert same_bytes(values, v[row].to(FP8))
        assert same_bytes(cache[block, 1, 0, offset], k[row].to(FP8))
        assert same_bytes(cache_values(cache, 1)[block, offset], v[row].to(FP8))


@pytest.mark.parametrize("cache_dtype", [None, FP8], ids=["same-cache", "fp8-cache"])
def test_latent_rows_fill_a_one_sided_cache(cache_dtype):
    """An MLA model's cache: one side, one head of 576 values (not a power of two), no v."""
    slots = [0, 15, -1, 16, 37]
    cache = random_tensor(4, 2, 1, 16, 1, 576, dtype=cache_dtype or torch.float32, seed=3)
    expected = cache.clone()
    rows = random_tensor(len(slots), 1, 576, seed=4)
    slot_mapping = torch.tensor(slots, dtype=torch.int64)
    write_kv(rows, None, cache, 1, slot_mapping)
    write_kv_reference(rows, None, expected, 1, slot_mapping)
    assert same_bytes(cache, expected)
    assert same_bytes(cache[2, 1, 0, 5], rows[4].to(cache.dtype))  # slot 37: block 2, offset 5, laid out as keys
    with pytest.raises(ValueError, match=r"dim 2 must be 2 \(k, v\)"):
        write_kv(rows, rows, cache, 1, slot_mapping)


def test_bad_arguments_are_refused():
    cache = torch.zeros(4, 2, 2, 16, 2, 32)
    k = torch.zeros(3, 2, 32)
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv(k, k, cache, 0, torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="layer 2 out of range"):
        write_kv(k, k, cache, 2, torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"k must be \[rows, 2, 32\]"):
        write_kv(torch.zeros(3, 4, 32), k, cache, 0, torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="k must be one of"):
        write_kv(k.double(), k, cache, 0, torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="k must be one of"):
        write_kv(k.bfloat16(), k.bfloat16(), cache, 0, torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="k is torch.float32, v is torch.bfloat16"):
        write_kv(k, k.bfloat16(), cache.to(FP8), 0, torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="kv_cache must be one of"):
        write_kv(k, k, cache.to(torch.float8_e5m2), 0, torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"dim 2 must be 1 \(latent rows, no v\)"):
        write_kv(k, None, cache, 0, torch.zeros(3, dtype=torch.int64))


@pytest.mark.parametrize("cache_dtype", [None, FP8], ids=["same-cache", "fp8-cache"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@gpu[0]
@gpu[1]
def test_gpu_realistic(dtype, cache_dtype):
    generator = torch.Generator().manual_seed(0)
    slots = torch.randperm(900 * 16, generator=generator)[:3000]
    slots[::7] = -1
    spread = torch.exp2(torch.randint(-14, 10, (3000, 8, 128), generator=generator)).cuda()
    _check_write(slots.tolist(), block_size=16, num_kv_heads=8, head_dim=128, layer=2, dtype=dtype,
                 cache_dtype=cache_dtype, device="cuda", kv_scale=spread if cache_dtype else 1.0)
