"""A mixture-of-experts layer's experts, fused: `out[t] = sum_k w[t,k] * expert_{ids[t,k]}(hidden[t])`.

    expert_e(x) = w2[e] @ (silu(w13[e, :I] @ x) * (w13[e, I:] @ x))

hidden `[T, H]`; w13 `[E, 2I, H]` (each expert's `[gate | up]` rows); w2 `[E, H, I]`;
topk_weights `[T, K]` (float32 or hidden's dtype); topk_ids `[T, K]` (int32 or int64). The
result is `[T, H]` in hidden's dtype. Products and the sum over the K choices accumulate in
float32; the silu * up rows between the two products are kept in hidden's dtype, and so is
each choice's output on the grouped path (worker/models/layers.py's `fused_experts`, the
contract, rounds after every operation in hidden's dtype: bf16 results differ by rounding).

FP8 weights, weight-only ("W8A16"): w13 and w2 in float8 e4m3fn, each with one float32 scale
per output row, w13_scale `[E, 2I]` and w2_scale `[E, H]` (fp8_linear.py's `quantize_rows`):
expert e's weight row r stands for `w[e, r] * scale[e, r]`. The kernels widen each fp8 tile to
hidden's dtype (exactly: e4m3 values are bf16 and fp16 values) for the products, and scale the
float32 sums in the epilogue, gate and up each by their own rows' scales before silu * up, down
by w2's before the routing weight. Activations stay in hidden's dtype. An expert's weights are
then half the bytes of bf16 ones, which is what a small batch's time is made of.

Two paths, chosen per token count by kernels/moe_config.py:
- pairs (kernels/moe_pairs.py): two launches, one program per token-expert pair; small batches.
- grouped (kernels/moe_align.py, kernels/moe_grouped.py): the pairs sorted by expert into
  padded blocks, then grouped tensor-core products and the sum over K: four or five launches.

Either reads only the chosen experts' weights, and its grids and buffers depend on T, K, E
and the tiles only, never on the ids: no host sync, so a call can be captured in a CUDA
graph and replayed with new inputs. Expert ids must lie in [0, E): the CPU path checks them;
on a GPU that would cost a sync, so there it is the caller's duty.
"""

from __future__ import annotations

import torch

from spillway.kernels.fp8 import FP8_E4M3
from spillway.kernels.moe_config import MoeConfig, config_for, device_name
from spillway.kernels.moe_grouped import grouped_experts
from spillway.kernels.moe_pairs import pair_experts
from spillway.kernels.utils import FLOAT_DTYPES, INDEX_DTYPES, check, check_tensor


def fused_experts(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    config: MoeConfig | None = None,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """`[T, H]` in hidden's dtype (see the module's docstring); `config` overrides the tuned tiles.
    `w13_scale` and `w2_scale` go with float8 e4m3fn weights, and only with them."""
    _check_arguments(hidden, w13, w2, topk_weights, topk_ids)
    _check_scales(w13, w13_scale, w2, w2_scale)
    num_tokens, hidden_size = hidden.shape
    if num_tokens == 0:
        return torch.empty((0, hidden_size), dtype=hidden.dtype, device=hidden.device)
    num_experts = w13.shape[0]
    if hidden.device.type != "cuda":
        _check_ids_in_range(topk_ids, num_experts)
    if config is None:
        config = config_for(num_experts, w2.shape[2], topk_ids.shape[1], device_name(hidden.device), hidden.dtype,
                            num_tokens, weight_dtype=w13.dtype)
    launch = pair_experts if config.path == "pairs" else grouped_experts
    return launch(hidden, w13, w2, topk_weights, topk_ids, config, w13_scale, w2_scale)


def _check_arguments(hidden, w13, w2, topk_weights, topk_ids) -> None:
    device = hidden.device
    check_tensor("hidden", hidden, ndim=2, dtypes=FLOAT_DTYPES, device=device)
    check_tensor("w13", w13, ndim=3, dtypes=(hidden.dtype, FP8_E4M3), device=device)
    check_tensor("w2", w2, ndim=3, dtypes=(hidden.dtype, FP8_E4M3), device=device)
    check(w2.dtype == w13.dtype, f"w13 is {w13.dtype} and w2 {w2.dtype}: both must be hidden's dtype, or both "
                                 f"float8_e4m3fn")
    num_experts, two_i, hidden_size = w13.shape
    check(hidden_size == hidden.shape[1], f"w13 is [E, 2I, H] with H = {hidden_size}, hidden has {hidden.shape[1]}")
    check(num_experts > 0 and two_i > 0 and two_i % 2 == 0,
          f"w13 must be [E, 2I, H] with E > 0 and an even, positive 2I, got shape {tuple(w13.shape)}")
    expected_w2 = (num_experts, hidden_size, two_i // 2)
    check(tuple(w2.shape) == expected_w2, f"w2 must be [E, H, I] = {list(expected_w2)}, got {list(w2.shape)}")
    check_tensor("topk_ids", topk_ids, ndim=2, dtypes=INDEX_DTYPES, device=device, last_dim_contiguous=False)
    check_tensor("topk_weights", topk_weights, ndim=2, dtypes=_routing_dtypes(hidden.dtype), device=device,
                 last_dim_contiguous=False)
    check(topk_ids.shape[0] == hidden.shape[0] and topk_ids.shape[1] > 0,
          f"topk_ids must be [T, K] with T = {hidden.shape[0]} and K > 0, got {list(topk_ids.shape)}")
    check(topk_weights.shape == topk_ids.shape,
          f"topk_weights' shape {list(topk_weights.shape)} differs from topk_ids' {list(topk_ids.shape)}")


def _check_scales(w13: torch.Tensor, w13_scale: torch.Tensor | None, w2: torch.Tensor,
                  w2_scale: torch.Tensor | None) -> None:
    """One float32 scale per output row of each fp8 weight; none for weights in hidden's dtype."""
    for name, weight, scale in (("w13", w13, w13_scale), ("w2", w2, w2_scale)):
        if weight.dtype != FP8_E4M3:
            check(scale is None, f"{name}_scale is given, but {name} is {weight.dtype}: scales go with "
                                 f"float8_e4m3fn weights only")
            continue
        rows = tuple(weight.shape[:2])
        check(scale is not None, f"{name} is float8_e4m3fn: {name}_scale, float32 {list(rows)} (one scale per "
                                 f"output row of each expert), is required")
        check_tensor(f"{name}_scale", scale, ndim=2, dtypes=(torch.float32,), device=weight.device)
        check(tuple(scale.shape) == rows, f"{name}_scale must be [E, rows of {name}] = {list(rows)}, "
                                          f"got {list(scale.shape)}")


def _routing_dtypes(dtype: torch.dtype) -> tuple[torch.dtype, ...]:
    return (torch.float32,) if dtype == torch.float32 else (torch.float32, dtype)


def _check_ids_in_range(topk_ids: torch.Tensor, num_experts: int) -> None:
    low, high = int(topk_ids.min()), int(topk_ids.max())
    check(0 <= low and high < num_experts, f"expert ids must lie in [0, {num_experts}), got {low}..{high}")


def fused_experts_reference(
    hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
    w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """`fused_experts` in plain torch, all in float32, rounded to hidden's dtype once (the
    kernels also round the silu * up rows, and on the grouped path each choice's output, to
    hidden's dtype). Expert by expert, as layers.py runs them; fp8 weights dequantized first
    (each row times its scale, in float32)."""
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    for expert in torch.unique(topk_ids).tolist():
        tokens, choices = torch.where(topk_ids == expert)
        gate, up = (hidden[tokens].float() @ _expert_weight(w13, w13_scale, expert).T).chunk(2, dim=-1)
        expert_out = (torch.nn.functional.silu(gate) * up) @ _expert_weight(w2, w2_scale, expert).T
        out.index_add_(0, tokens, expert_out * topk_weights[tokens, choices, None].float())
    return out.to(hidden.dtype)


def _expert_weight(weight: torch.Tensor, scale: torch.Tensor | None, expert: int) -> torch.Tensor:
    """Expert `expert`'s weight rows in float32, each times its scale where there are scales."""
    rows = weight[expert].float()
    return rows if scale is None else rows * scale[expert, :, None].float()
