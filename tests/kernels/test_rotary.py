"""apply_rotary against layers.py's apply_rotary: strided q/k views, odd head counts."""

import pytest
import torch
from kernel_testing import gpu, random_tensor

from spillway.kernels.rotary import apply_rotary, apply_rotary_reference, build_cos_sin_cache
from spillway.worker.models import layers


def _fused_qk(num_tokens, num_heads, num_kv_heads, head_dim, dtype=torch.float32, device="cpu"):
    qkv = random_tensor(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, device=device)
    q = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim].view(num_tokens, num_kv_heads, head_dim)
    return qkv, q, k


@pytest.mark.parametrize("heads", [(9, 3), (6, 1), (4, 4)])
def test_matches_layers_in_place(heads):
    num_heads, num_kv_heads = heads
    qkv, q, k = _fused_qk(7, num_heads, num_kv_heads, 32)
    untouched_v = qkv[:, (num_heads + num_kv_heads) * 32 :].clone()
    rotary = layers.RotaryEmbedding(32, 10000.0, None)
    positions = torch.tensor([0, 1, 15, 16, 17, 4095, 3])
    cos, sin = rotary.cos_sin(positions, torch.float32)
    expected_q, expected_k = layers.apply_rotary(q, cos, sin), layers.apply_rotary(k, cos, sin)
    cos_cache, sin_cache = build_cos_sin_cache(rotary.inv_freq, 4096, torch.device("cpu"))
    out_q, out_k = apply_rotary(q, k, positions, cos_cache, sin_cache)
    assert out_q is q and out_k is k
    torch.testing.assert_close(q, expected_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k, expected_k, rtol=1e-5, atol=1e-5)
    assert torch.equal(qkv[:, (num_heads + num_kv_heads) * 32 :], untouched_v)


def test_bad_arguments_are_refused():
    q, k = torch.zeros(3, 4, 16), torch.zeros(3, 2, 16)
    cos = torch.zeros(10, 8)
    with pytest.raises(ValueError, match="positions has 2 entries for 3 tokens"):
        apply_rotary(q, k, torch.zeros(2, dtype=torch.int64), cos, cos)
    with pytest.raises(ValueError, match=r"cos_cache must be \[max_positions, 8\]"):
        apply_rotary(q, k, torch.zeros(3, dtype=torch.int64), torch.zeros(10, 16), cos)


@gpu[0]
@gpu[1]
def test_gpu_bf16():
    device = torch.device("cuda")
    _, q, k = _fused_qk(500, 32, 8, 128, dtype=torch.bfloat16, device=device)
    rotary = layers.RotaryEmbedding(128, 1_000_000.0, None)
    cos_cache, sin_cache = build_cos_sin_cache(rotary.inv_freq, 40960, device)
    positions = torch.randint(0, 40960, (500,), generator=torch.Generator().manual_seed(0)).to(device)
    expected_q, expected_k = apply_rotary_reference(q, k, positions, cos_cache, sin_cache)
    apply_rotary(q, k, positions, cos_cache, sin_cache)
    torch.testing.assert_close(q, expected_q, rtol=2**-7, atol=1e-2)
    torch.testing.assert_close(k, expected_k, rtol=2**-7, atol=1e-2)
