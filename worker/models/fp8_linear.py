"""FP8 projections: weights in float8 e4m3fn with one scale per output row, activations
quantized per token as they arrive.

    weight   w_q [out, in] float8_e4m3fn, w_scale [out] float32: w ~ w_q * w_scale[:, None]
    input    x_q [rows, in] float8_e4m3fn, x_scale [rows] float32, from x's amax per row / 448
    output   y = (x_q @ w_q^T) * x_scale[:, None] * w_scale[None, :] (+ bias), in x's dtype

On CUDA the product is one `torch._scaled_mm` (FP8 tensor cores, row-wise scales, float32
accumulation: compute capability 8.9 or newer); anywhere else the same arithmetic in plain
torch, the fp8 values widened to float32 (`fp8_linear_reference`), which is what the CUDA path
is tested against. The weight stays `[out, in]` row-major: its transpose is the column-major
second operand `_scaled_mm` asks for, so the GPU's input-major re-layout (gpu_linear.py) and
the CPU's oneDNN packing (cpu_linear.py) leave an `Fp8Linear` alone (it is no `nn.Linear`).

`quantize_linear_layers(model)` swaps every projection of the decoder layers for one (after
tensor-parallel sharding: each rank's scales are its own rows'); embeddings, the lm_head,
norms and routers stay as they are. The experts' stacked weights take the same row scales but
keep their activations unquantized (fp8_experts.py).
"""

from __future__ import annotations

import torch
from torch import nn

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
# The smallest amax a row is scaled by: an all-zero row quantizes to zeros, not to NaN.
MIN_AMAX = 1e-12
# `_scaled_mm` takes FP8 operands from Ada and Hopper on (sm_89, sm_90).
MIN_CAPABILITY = (8, 9)
# cuBLASLt's FP8 products need both dimensions of the weight to be multiples of 16.
SCALED_MM_ALIGNMENT = 16


def quantize_rows(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(q, scale)` with `q` float8 e4m3fn of `values`' shape and `scale` float32 `[rows]`, one per
    row of the last dim (amax / 448), so that `q * scale[..., None]` is `values` to fp8 rounding."""
    amax = values.abs().amax(dim=-1, keepdim=True).float().clamp(min=MIN_AMAX)
    scale = amax / FP8_MAX
    quantized = (values.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return quantized, scale.squeeze(-1)


def dequantize_rows(quantized: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values `quantize_rows` stands for, in `dtype`."""
    return (quantized.float() * scale.float()[..., None]).to(dtype)


def fp8_linear_reference(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                         bias: torch.Tensor | None) -> torch.Tensor:
    """The product in plain torch: x `[..., in]` quantized per token, both fp8 operands widened
    to float32, scaled, the bias added in float32; the result in x's dtype."""
    rows = x.reshape(-1, x.shape[-1])
    x_q, x_scale = quantize_rows(rows)
    out = (x_q.float() @ weight.float().t()) * x_scale[:, None] * weight_scale[None, :]
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])


def fp8_linear_scaled_mm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                         bias: torch.Tensor | None) -> torch.Tensor:
    """The product on FP8 tensor cores (CUDA): `torch._scaled_mm` with row-wise scales, which
    writes bfloat16 only; the bias is added after, in x's dtype."""
    rows = x.reshape(-1, x.shape[-1])
    x_q, x_scale = quantize_rows(rows)
    out = torch._scaled_mm(x_q, weight.t(), scale_a=x_scale[:, None], scale_b=weight_scale[None, :],
                           out_dtype=torch.bfloat16)
    out = out.to(x.dtype)
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


class Fp8Linear(nn.Module):
    """`y = x W^T + b` with W in float8 e4m3fn and a float32 scale per output row (module docstring)."""

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        assert weight.dtype == FP8_DTYPE and weight.dim() == 2, f"an fp8 [out, in] weight, got {weight.dtype}"
        assert weight_scale.shape == (weight.shape[0],), f"one scale per row, got {tuple(weight_scale.shape)}"
        self.out_features, self.in_features = weight.shape
        self.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
        self.weight_scale = nn.Parameter(weight_scale.float().contiguous(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.aligned = self.in_features % SCALED_MM_ALIGNMENT == 0 and self.out_features % SCALED_MM_ALIGNMENT == 0

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Fp8Linear:
        """`linear`'s weight quantized per output row; its bias kept in the model's dtype."""
        weight, scale = quantize_rows(linear.weight.detach())
        return cls(weight, scale, linear.bias)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_rows(self.weight, self.weight_scale, dtype)

    @property
    def product(self):
        """`_scaled_mm` on CUDA where cuBLASLt takes the shape; the plain-torch reference otherwise
        (decided per call: the module may move between devices)."""
        return fp8_linear_scaled_mm if self.weight.is_cuda and self.aligned else fp8_linear_reference

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x, self.weight, self.weight_scale, self.bias)

    def extra_repr(self) -> str:
        path = "scaled_mm" if self.product is fp8_linear_scaled_mm else "reference"
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, product={path}")


def fp8_capability_problem(device: torch.device) -> str | None:
    """Why `device` cannot run FP8 products, or None (the CPU runs the plain-torch reference)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    capability = torch.cuda.get_device_capability(device)
    if capability >= MIN_CAPABILITY:
        return None
    name = torch.cuda.get_device_name(device)
    return (f"FP8 weights need FP8 tensor cores (compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or "
            f"newer: Ada, Hopper); {name} has {capability[0]}.{capability[1]}. Serve the model unquantized")


def decoder_projections(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """Every `nn.Linear` of the decoder layers (q/k/v or qkv, o, gate/up, down, the shared
    experts', MLA's), by name; not the lm_head, embeddings, norms, routers or stacked experts."""
    return [(name, module) for name, module in model.named_modules()
            if type(module) is nn.Linear and ".layers." in f".{name}"]


def quantize_linear_layers(model: nn.Module) -> int:
    """Replace every decoder projection of a loaded (and, with tensor parallelism, sharded)
    model with an `Fp8Linear`; returns how many. ValueError on a GPU without FP8 tensor cores."""
    projections = decoder_projections(model)
    if projections:
        problem = fp8_capability_problem(projections[0][1].weight.device)
        if problem is not None:
            raise ValueError(problem)
    with torch.no_grad():
        for name, linear in projections:
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name), child, Fp8Linear.from_linear(linear))
    return len(projections)
