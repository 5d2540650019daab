"""silu_and_mul against layers.py's silu_and_mul: odd widths, strided rows, bf16 on the GPU."""

import pytest
import torch
from kernel_testing import gpu, random_tensor

from spillway.kernels.activation import silu_and_mul
from spillway.worker.models import layers


@pytest.mark.parametrize("shape", [(5, 90), (1, 2), (3, 2 * 1100)])
def test_matches_layers(shape):
    x = random_tensor(*shape) * 4
    torch.testing.assert_close(silu_and_mul(x), layers.silu_and_mul(x), rtol=1e-5, atol=1e-6)


def test_strided_rows():
    wide = random_tensor(4, 100)
    x = wide[:, :64]
    out = silu_and_mul(x)
    assert out.shape == (4, 32) and out.is_contiguous()
    torch.testing.assert_close(out, layers.silu_and_mul(x), rtol=1e-5, atol=1e-6)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="must be even"):
        silu_and_mul(torch.zeros(2, 5))


@gpu[0]
@gpu[1]
def test_gpu_bf16():
    x = random_tensor(257, 2 * 12288, dtype=torch.bfloat16, device=torch.device("cuda")) * 4
    torch.testing.assert_close(silu_and_mul(x), layers.silu_and_mul(x), rtol=2**-7, atol=1e-2)
