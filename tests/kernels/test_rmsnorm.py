"""rms_norm and fused_add_rms_norm against layers.py's arithmetic: odd widths, per-head
norms on strided q views, in-place use, bf16 on the GPU."""

import pytest
import torch
from kernel_testing import gpu, random_tensor

from spillway.kernels.rmsnorm import fused_add_rms_norm, fused_add_rms_norm_reference, rms_norm, rms_norm_reference
from spillway.worker.models import layers


@pytest.mark.parametrize("shape", [(7, 33), (1, 64), (33,)])
def test_rms_norm_matches_layers(shape):
    x = random_tensor(*shape) * 3
    weight = random_tensor(shape[-1], seed=2)
    torch.testing.assert_close(rms_norm(x, weight, 1e-6), layers.rms_norm(x, weight, 1e-6), rtol=1e-5, atol=1e-5)


def test_per_head_norm_on_a_strided_view():
    """Qwen3 normalises each head of q, a view into the fused qkv output."""
    qkv = random_tensor(5, (4 + 2 * 2) * 32)
    q = qkv[:, : 4 * 32].view(5, 4, 32)
    weight = random_tensor(32, seed=2)
    out = rms_norm(q, weight, 1e-6)
    assert out.is_contiguous()
    torch.testing.assert_close(out, rms_norm_reference(q, weight, 1e-6), rtol=1e-5, atol=1e-5)


def test_fused_add_matches_the_decoder_pattern():
    x, residual, weight = random_tensor(6, 48), random_tensor(6, 48, seed=3), random_tensor(48, seed=2)
    normed, new_residual = fused_add_rms_norm(x, residual, weight, 1e-5)
    torch.testing.assert_close(new_residual, x + residual, rtol=0, atol=0)
    torch.testing.assert_close(normed, layers.rms_norm(x + residual, weight, 1e-5), rtol=1e-5, atol=1e-5)


def test_fused_add_in_place():
    x, residual, weight = random_tensor(6, 48), random_tensor(6, 48, seed=3), random_tensor(48, seed=2)
    expected = fused_add_rms_norm_reference(x, residual, weight, 1e-5)
    normed, new_residual = fused_add_rms_norm(x, residual, weight, 1e-5, inplace=True)
    assert normed is x and new_residual is residual
    torch.testing.assert_close(x, expected[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(residual, expected[1], rtol=0, atol=0)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="weight has 8 entries for a last dim of 16"):
        rms_norm(torch.zeros(2, 16), torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="residual's shape"):
        fused_add_rms_norm(torch.zeros(2, 16), torch.zeros(3, 16), torch.ones(16), 1e-6)
    with pytest.raises(ValueError, match="contiguous last dim"):
        rms_norm(torch.zeros(16, 2).t(), torch.ones(16), 1e-6)


@gpu[0]
@gpu[1]
@pytest.mark.parametrize("hidden", [4096, 576, 128])
def test_gpu_bf16_matches_layers(hidden):
    device = torch.device("cuda")
    x = random_tensor(300, hidden, dtype=torch.bfloat16, device=device) * 4
    residual = random_tensor(300, hidden, dtype=torch.bfloat16, device=device, seed=3)
    weight = random_tensor(hidden, dtype=torch.bfloat16, device=device, seed=2)
    # One bf16 ulp at most: rsqrt may round differently from torch's.
    ulp = dict(rtol=2**-7, atol=1e-2)
    torch.testing.assert_close(rms_norm(x, weight, 1e-6), layers.rms_norm(x, weight, 1e-6), **ulp)
    normed, new_residual = fused_add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(new_residual, x + residual)
    torch.testing.assert_close(normed, layers.rms_norm(x + residual, weight, 1e-6), **ulp)
