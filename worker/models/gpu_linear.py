"""The decoder's projection weights on a GPU: stored input-major, so cuBLAS reads them faster.

`nn.Linear` keeps its weight `[out, in]` row-major and `F.linear` multiplies by its transpose.
At the one-row products of decoding (a read of the weight, nothing else), cuBLAS picks other
kernels for a weight stored `[in, out]` row-major (the same `[out, in]` tensor, column-major):
batch-1 decode of the Qwen3-8B shape ran 1.037x faster on an H200 (docs/performance.md, run L).
`F.linear` accepts either storage and passes cuBLAS the matching transpose flag; the values,
shapes and names of the parameters do not change, only their strides.
"""

from __future__ import annotations

import torch
from torch import nn


def store_weights_input_major(model: nn.Module) -> int:
    """Re-lay every `nn.Linear` weight of `model`'s decoder layers as column-major `[out, in]`
    (row-major `[in, out]`); the lm_head and embedding stay as they are (rows are looked up).
    Returns how many weights were re-laid. Call after the weights are loaded."""
    count = 0
    with torch.no_grad():
        for name, module in model.named_modules():
            if not isinstance(module, nn.Linear) or ".layers." not in f".{name}":
                continue
            weight = module.weight
            if weight.dim() == 2 and weight.stride() != (1, weight.shape[0]):
                weight.data = weight.data.t().contiguous().t()
                count += 1
    return count
