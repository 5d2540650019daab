"""SwiGLU's `silu(gate) * up` on a fused `[gate | up]` projection output.

Rounding follows torch's as layers.py uses it: silu is computed in float32 and rounded to
x's dtype, then the product is computed in float32 and rounded again.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from spillway.kernels.utils import FLOAT_DTYPES, check, check_tensor, for_device, wait_for_inputs


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, stride_x, stride_o, intermediate,
    BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < intermediate
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + intermediate + cols, mask=mask, other=0.0)
    gate_float = gate.to(tl.float32)
    silu = (gate_float / (1.0 + tl.exp(-gate_float))).to(gate.dtype)
    out = silu.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """`silu(x[..., :I]) * x[..., I:]` for x `[rows, 2I]`; returns a new contiguous `[rows, I]`."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES, device=x.device)
    num_rows, width = x.shape
    check(width % 2 == 0, f"x's last dim must be even ([gate | up]), got {width}")
    intermediate = width // 2
    out = torch.empty((num_rows, intermediate), dtype=x.dtype, device=x.device)
    if num_rows == 0 or intermediate == 0:
        return out
    block = min(1024, triton.next_power_of_2(intermediate))
    for_device(_silu_and_mul_kernel, x.device)[(num_rows, triton.cdiv(intermediate, block))](
        x, out, x.stride(0), out.stride(0), intermediate,
        BLOCK=block, num_warps=4,
    )
    return out


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """The plain-torch arithmetic of worker/models/layers.py."""
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up
