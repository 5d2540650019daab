"""Linear layers on the CPU through oneDNN with weights packed once at load time.

`torch.nn.functional.linear` on the CPU calls the BLAS sgemm, which is slow for the short,
wide products of decoding (16 rows against a 576 x 49152 lm_head): on the CPU machines
measured in docs/performance.md it reaches a third of memory bandwidth. oneDNN's
inner-product primitive with the weight reordered into its blocked layout once does the
same products two to three times faster. Results differ from sgemm only in summation
order (relative 1e-6 in float32).

`pack_linear_layers(model)` swaps every `nn.Linear` of a loaded model for a `PackedLinear`
holding the reordered weight. The dense weight is released, except where another module
shares it (a tied lm_head keeps the embedding table). Where this torch build has no oneDNN
linear, or its result disagrees with `F.linear`, the model is left as it is. It first bounds
the caches that keep a compiled kernel per input shape (`bound_kernel_caches`).
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

PACKABLE_DTYPES = (torch.float32, torch.bfloat16)


# oneDNN builds a primitive for every input shape it meets. Row counts above EXACT_ROWS are
# padded up to one of ROW_STEPS_PER_OCTAVE sizes per power of two (at most 1/8 more rows), so a
# worker meets a bounded set of shapes, ~100 up to 8,192 rows, and the kernel caches below
# (CACHED_KERNELS) hold a larger share of the ones in use.
EXACT_ROWS = 32
ROW_STEPS_PER_OCTAVE = 8


# Each shape's kernel is cached twice, by oneDNN (its primitive cache) and by torch's ideep layer
# (an LRU of its own), ~0.3 MB each whatever the weight's size, 1,024 of each by default: a
# server meeting new step sizes grew for hundreds of MB (~3 MB per new row count of a model's
# five weight shapes). CACHED_KERNELS of each keeps the few shapes a run of steps reuses (the
# decode batch sizes); an evicted one is rebuilt in ~0.4 ms, against the tens of ms of the
# product that needs it.
CACHED_KERNELS = 64
KERNEL_CACHE_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def bound_kernel_caches() -> None:
    """Cap both per-shape kernel caches at CACHED_KERNELS, where the environment does not set
    them. Each reads its variable once, when the first oneDNN product runs: call this before."""
    for name in KERNEL_CACHE_VARIABLES:
        os.environ.setdefault(name, str(CACHED_KERNELS))


def padded_rows(rows: int) -> int:
    """The row count a product of `rows` rows runs at."""
    if rows <= EXACT_ROWS:
        return rows
    step = 1 << max(rows.bit_length() - ROW_STEPS_PER_OCTAVE.bit_length(), 0)
    return -(-rows // step) * step


class PackedLinear(nn.Module):
    """`y = x W^T + b` with W in oneDNN's reordered layout (an opaque tensor: no views)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # Not a parameter: the opaque tensor has no storage to save, view or copy into.
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach())
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features) if x.dim() != 2 else x
        padded = padded_rows(rows.shape[0])
        if padded != rows.shape[0]:
            rows = F.pad(rows, (0, 0, 0, padded - rows.shape[0]))
        out = torch.ops.mkldnn._linear_pointwise(rows, self.packed_weight, self.bias, "none", [None], "")
        return out[: x.numel() // self.in_features].reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def onednn_linear_works(dtype: torch.dtype) -> bool:
    """Whether the packed oneDNN linear exists here and agrees with `F.linear` in `dtype`."""
    if dtype not in PACKABLE_DTYPES or not torch.backends.mkldnn.is_available():
        return False
    generator = torch.Generator().manual_seed(0)
    linear = nn.Linear(96, 80, dtype=dtype)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(80, 96, generator=generator))
        linear.bias.copy_(torch.randn(80, generator=generator))
    x = torch.randn(5, 96, generator=generator).to(dtype)
    try:
        with torch.no_grad():
            got = PackedLinear(linear)(x).float()
    except (RuntimeError, AttributeError, NotImplementedError) as error:
        logger.info("oneDNN linear unavailable (%s); using torch.nn.functional.linear", error)
        return False
    expected = F.linear(x, linear.weight, linear.bias).float()
    tolerance = 1e-4 if dtype == torch.float32 else 0.25
    return got.shape == expected.shape and bool(torch.allclose(got, expected, rtol=0, atol=tolerance))


def pack_linear_layers(model: nn.Module) -> int:
    """Replace every `nn.Linear` of a CPU model with a `PackedLinear`; returns how many.

    Call after the weights are loaded. Returns 0, changing nothing, where the model is not on
    the CPU, not float32/bfloat16, or oneDNN's linear is unavailable or wrong here.
    """
    bound_kernel_caches()
    linears = [(name, module) for name, module in model.named_modules() if type(module) is nn.Linear]
    if not linears:
        return 0
    weight = linears[0][1].weight
    if weight.device.type != "cpu" or not onednn_linear_works(weight.dtype):
        return 0
    with torch.no_grad():
        for name, module in linears:
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, PackedLinear(module))
    return len(linears)
