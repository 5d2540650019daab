"""A mixture-of-experts router's softmax top-k in one launch (Qwen3-MoE, Mixtral):

    probs = softmax(logits[t], float32);  ids = the top_k of probs;  weights = probs[ids]
    renormalize: weights /= sum(weights);  round_to_logits_dtype: weights = float(dtype(weights))

worker/models/routers.py's `softmax_topk` is the contract (torch's softmax, topk, division and
casts: four to six launches and a sort). One program a token: its row of at most 1,024
experts in registers, the k best by repeated arg-max. Ties go to the lower expert id (torch's
topk leaves their order open). Weights come back float32 `[T, K]`, ids int32 `[T, K]`: what
kernels/fused_moe.py reads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from spillway.kernels.utils import FLOAT_DTYPES, check, check_tensor, for_device, wait_for_inputs

MAX_EXPERTS = 1024  # one row in one program's registers


@triton.jit
def _softmax_topk_kernel(
    logits_ptr, weights_ptr, ids_ptr, stride_logits, num_experts,
    TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
    RENORMALIZE: tl.constexpr, ROUND_TO_LOGITS_DTYPE: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, BLOCK_E)
    present = experts < num_experts
    logits = tl.load(logits_ptr + row * stride_logits + experts, mask=present, other=float("-inf"))
    scores = logits.to(tl.float32)
    exps = tl.where(present, tl.exp(scores - tl.max(scores, axis=0)), 0.0)
    probs = exps / tl.sum(exps, axis=0)
    left = tl.where(present, probs, -1.0)  # probabilities are >= 0: -1 marks a taken or absent expert
    slots = tl.arange(0, BLOCK_K)
    weights = tl.zeros([BLOCK_K], dtype=tl.float32)
    ids = tl.zeros([BLOCK_K], dtype=tl.int32)
    for k in tl.static_range(TOP_K):
        best = tl.max(left, axis=0)
        chosen = tl.min(tl.where(left == best, experts, BLOCK_E), axis=0)
        weights = tl.where(slots == k, best, weights)
        ids = tl.where(slots == k, chosen, ids)
        left = tl.where(experts == chosen, -1.0, left)
    if RENORMALIZE:
        weights = weights / tl.sum(tl.where(slots < TOP_K, weights, 0.0), axis=0)
    if ROUND_TO_LOGITS_DTYPE:
        if logits.dtype == tl.bfloat16:
            # Round to nearest even on the bits (weights are finite and >= 0): the same on a GPU
            # and in Triton's interpreter, whose bfloat16 casts truncate.
            bits = weights.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            weights = bits.to(tl.float32, bitcast=True)
        else:
            weights = weights.to(logits.dtype).to(tl.float32)
    kept = slots < TOP_K
    tl.store(weights_ptr + row * TOP_K + slots, weights, mask=kept)
    tl.store(ids_ptr + row * TOP_K + slots, ids, mask=kept)


def softmax_topk(
    router_logits: torch.Tensor, top_k: int, *, renormalize: bool, weights_in_logits_dtype: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """routers.softmax_topk's (weights float32 `[T, K]`, ids) in one kernel; ids are int32."""
    check_tensor("router_logits", router_logits, ndim=2, dtypes=FLOAT_DTYPES, device=router_logits.device)
    num_tokens, num_experts = router_logits.shape
    check(0 < num_experts <= MAX_EXPERTS, f"router_logits must have 1 to {MAX_EXPERTS} experts, got {num_experts}")
    check(isinstance(top_k, int) and 0 < top_k <= num_experts, f"top_k must be in [1, {num_experts}], got {top_k!r}")
    weights = torch.empty((num_tokens, top_k), dtype=torch.float32, device=router_logits.device)
    ids = torch.empty((num_tokens, top_k), dtype=torch.int32, device=router_logits.device)
    if num_tokens == 0:
        return weights, ids
    block_e = triton.next_power_of_2(num_experts)
    for_device(_softmax_topk_kernel, router_logits.device)[(num_tokens,)](
        router_logits, weights, ids, router_logits.stride(0), num_experts,
        TOP_K=top_k, BLOCK_E=block_e, BLOCK_K=triton.next_power_of_2(top_k),
        RENORMALIZE=renormalize, ROUND_TO_LOGITS_DTYPE=weights_in_logits_dtype,
        num_warps=1 if block_e <= 256 else 4,
    )
    return weights, ids
