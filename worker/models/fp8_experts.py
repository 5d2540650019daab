"""FP8 experts: a mixture-of-experts layer's stacked expert weights in float8 e4m3fn, one float32
scale per output row of each expert, run weight-only ("W8A16") by `ops.fused_experts`.

    gate_up_proj  [E, 2I, H] float8_e4m3fn   gate_up_proj_scale  [E, 2I] float32
    down_proj     [E, H, I]  float8_e4m3fn   down_proj_scale     [E, H]  float32
                  expert e's row r stands for `w[e, r] * scale[e, r]` (fp8_linear.py's `quantize_rows`)

Activations stay in the model's dtype: the fused kernel (kernels/fused_moe.py) widens each fp8
tile for its products and scales the sums, the CPU path (layers.py's `fused_experts`) dequantizes
each chosen expert as it runs. Either way an expert reads half the bytes of bf16 weights, and a
decode step's experts are bound by those reads. (The dense projections quantize activations
too, fp8_linear.py; the experts' products are many small ones, one per expert, which the one
fused kernel runs without per-token scales.)

`quantize_experts(model)` swaps every `Experts` of a loaded, and with tensor parallelism sharded,
model for an `Fp8Experts`: each rank's scales are those of its own rows (a down_proj row holds
the rank's slice of the expert's width only).
"""

from __future__ import annotations

import torch
from torch import nn

from spillway.worker.models.fp8_linear import FP8_DTYPE, dequantize_rows, fp8_capability_problem, quantize_rows
from spillway.worker.models.layers import DecoderOps
from spillway.worker.models.sparse_moe import Experts


class Fp8Experts(nn.Module):
    """Every expert's gated MLP, stacked, in fp8 with row scales (module docstring); the same
    `forward` as `Experts`."""

    def __init__(self, gate_up_proj: torch.Tensor, gate_up_proj_scale: torch.Tensor, down_proj: torch.Tensor,
                 down_proj_scale: torch.Tensor, ops: DecoderOps) -> None:
        super().__init__()
        num_experts, two_width, hidden_size = gate_up_proj.shape
        assert gate_up_proj.dtype == down_proj.dtype == FP8_DTYPE, "fp8 expert weights"
        assert down_proj.shape == (num_experts, hidden_size, two_width // 2), f"down_proj {tuple(down_proj.shape)}"
        assert gate_up_proj_scale.shape == (num_experts, two_width), "one scale per gate/up row"
        assert down_proj_scale.shape == (num_experts, hidden_size), "one scale per down row"
        self.ops = ops
        self.gate_up_proj = nn.Parameter(gate_up_proj.contiguous(), requires_grad=False)
        self.gate_up_proj_scale = nn.Parameter(gate_up_proj_scale.float().contiguous(), requires_grad=False)
        self.down_proj = nn.Parameter(down_proj.contiguous(), requires_grad=False)
        self.down_proj_scale = nn.Parameter(down_proj_scale.float().contiguous(), requires_grad=False)

    @classmethod
    def from_experts(cls, experts: Experts) -> Fp8Experts:
        """`experts`' stacks quantized per output row, one expert at a time (a whole stack in
        float32 at once would take twice its bf16 size again, on the device)."""
        gate_up, gate_up_scale = quantize_stack(experts.gate_up_proj.detach())
        down, down_scale = quantize_stack(experts.down_proj.detach())
        return cls(gate_up, gate_up_scale, down, down_scale, experts.ops)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """`(gate_up_proj, down_proj)` as the weights stand for them, in `dtype`."""
        return (dequantize_rows(self.gate_up_proj, self.gate_up_proj_scale, dtype),
                dequantize_rows(self.down_proj, self.down_proj_scale, dtype))

    def forward(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        return self.ops.fused_experts(hidden, self.gate_up_proj, self.down_proj, topk_weights, topk_ids,
                                      w13_scale=self.gate_up_proj_scale, w2_scale=self.down_proj_scale)

    def extra_repr(self) -> str:
        num_experts, two_width, hidden_size = self.gate_up_proj.shape
        return f"num_experts={num_experts}, hidden_size={hidden_size}, width={two_width // 2}, weights=fp8"


def quantize_stack(stack: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rows` of a stack `[E, rows, columns]`, expert by expert."""
    quantized = torch.empty(stack.shape, dtype=FP8_DTYPE, device=stack.device)
    scale = torch.empty(stack.shape[:2], dtype=torch.float32, device=stack.device)
    for expert in range(stack.shape[0]):
        quantized[expert], scale[expert] = quantize_rows(stack[expert])
    return quantized, scale


def expert_stack_names(model: nn.Module) -> list[str]:
    """The module name of every mixture-of-experts layer's `Experts`."""
    return [name for name, module in model.named_modules() if type(module) is Experts]


def quantize_experts(model: nn.Module) -> int:
    """Replace every `Experts` of a loaded (and, with tensor parallelism, sharded) model with an
    `Fp8Experts`; returns how many. ValueError on a GPU without FP8 support (fp8_linear.py).
    Layer by layer, each unquantized stack dropped once its layer's is made: the model never
    holds both in full."""
    names = expert_stack_names(model)
    if names:
        problem = fp8_capability_problem(model.get_submodule(names[0]).gate_up_proj.device)
        if problem is not None:
            raise ValueError(problem)
    with torch.no_grad():
        for name in names:
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            setattr(parent, child, Fp8Experts.from_experts(getattr(parent, child)))
    return len(names)
