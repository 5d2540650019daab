"""RMSNorm, alone and fused with the residual add that precedes it in a decoder layer.

Arithmetic follows worker/models/layers.py's `rms_norm` (Hugging Face's): normalise in
float32, round to x's dtype, then scale by the weight and round again. The fused form
first rounds `x + residual` to x's dtype, as `hidden = hidden + attn_out` does in torch:

    new_residual = (x + residual) in x.dtype
    normed       = rms_norm(new_residual, weight, eps)

x may be `[hidden]`, `[rows, hidden]` or `[rows, heads, head_dim]` (Qwen3's per-head q/k norm) with
arbitrary strides on the leading dims; the last dim must be contiguous.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from spillway.kernels.utils import (
    FLOAT_DTYPES,
    check,
    check_tensor,
    for_device,
    next_power_of_2,
    wait_for_inputs,
)


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, new_residual_ptr,
    inner, stride_x_outer, stride_x_inner, stride_r_outer, stride_r_inner,
    stride_o_outer, stride_o_inner, stride_n_outer, stride_n_inner,
    hidden, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    row = tl.program_id(0)
    outer = (row // inner).to(tl.int64)
    inner_idx = row % inner
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + outer * stride_x_outer + inner_idx * stride_x_inner + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + outer * stride_r_outer + inner_idx * stride_r_inner + cols,
                           mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x.dtype)
        tl.store(new_residual_ptr + outer * stride_n_outer + inner_idx * stride_n_inner + cols, x, mask=mask)
    x_float = x.to(tl.float32)
    variance = tl.sum(x_float * x_float, 0) / hidden
    normed = (x_float * tl.math.rsqrt(variance + eps)).to(x.dtype)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    out = normed.to(tl.float32) * weight.to(tl.float32)
    tl.store(out_ptr + outer * stride_o_outer + inner_idx * stride_o_inner + cols,
             out.to(out_ptr.dtype.element_ty), mask=mask)


def _as_3d(tensor: torch.Tensor) -> torch.Tensor:
    """A `[outer, inner, hidden]` view of a 1-, 2- or 3-dim tensor."""
    if tensor.dim() == 1:
        return tensor.view(1, 1, -1)
    return tensor.unsqueeze(1) if tensor.dim() == 2 else tensor


def _launch(x, residual, weight, eps, out, new_residual) -> None:
    device = x.device
    check_tensor("x", x, ndim=(1, 2, 3), dtypes=FLOAT_DTYPES, device=device)
    hidden = x.shape[-1]
    check_tensor("weight", weight, ndim=1, dtypes=FLOAT_DTYPES, device=device)
    check(weight.shape[0] == hidden, f"weight has {weight.shape[0]} entries for a last dim of {hidden}")
    if residual is not None:
        check_tensor("residual", residual, ndim=x.dim(), dtypes=(x.dtype,), device=device)
        check(residual.shape == x.shape,
              f"residual's shape {tuple(residual.shape)} differs from x's {tuple(x.shape)}")
    x3, out3 = _as_3d(x), _as_3d(out)
    r3 = _as_3d(residual) if residual is not None else x3
    n3 = _as_3d(new_residual) if new_residual is not None else out3
    outer, inner = x3.shape[0], x3.shape[1]
    if outer * inner == 0:
        return
    block = next_power_of_2(hidden)
    for_device(_rms_norm_kernel, device)[(outer * inner,)](
        x3, r3, weight, out3, n3,
        inner, x3.stride(0), x3.stride(1), r3.stride(0), r3.stride(1),
        out3.stride(0), out3.stride(1), n3.stride(0), n3.stride(1),
        hidden, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=block,
        num_warps=min(16, max(1, block // 256)),
    )


def _out_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, weight.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`weight * rms_normalise(x)` over the last dim; a new contiguous tensor shaped like x."""
    out = torch.empty(x.shape, dtype=_out_dtype(x, weight), device=x.device)
    _launch(x, None, weight, eps, out, None)
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *, inplace: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(rms_norm(x + residual), x + residual)`.

    New tensors by default; `inplace=True` writes the normed rows into x and the sum into
    residual (both must then have x's dtype as the output dtype) and returns them.
    """
    if inplace:
        check(_out_dtype(x, weight) == x.dtype, "inplace needs weight's dtype to promote to x's")
        # Each program reads its whole row before writing it, so aliasing in and out is safe.
        _launch(x, residual, weight, eps, x, residual)
        return x, residual
    out = torch.empty(x.shape, dtype=_out_dtype(x, weight), device=x.device)
    new_residual = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(x, residual, weight, eps, out, new_residual)
    return out, new_residual


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The plain-torch arithmetic of worker/models/layers.py."""
    x_float = x.float()
    variance = x_float.pow(2).mean(-1, keepdim=True)
    return weight * (x_float * torch.rsqrt(variance + eps)).to(x.dtype)


def fused_add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    new_residual = x + residual
    return rms_norm_reference(new_residual, weight, eps), new_residual
