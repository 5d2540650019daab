"""kernels/moe_router.py's softmax top-k against worker/models/routers.py's: every option, odd
expert counts, strided logits, ties, bad arguments; bf16 at Qwen3-30B-A3B's shape on the GPU."""

import pytest
import torch
from kernel_testing import gpu

from spillway.kernels.moe_router import softmax_topk
from spillway.worker.models import routers


def distinct_logits(num_tokens: int, num_experts: int, *, dtype=torch.float32, device="cpu", seed=0):
    """Random logits with no two equal in a row (torch's topk orders ties its own way)."""
    generator = torch.Generator().manual_seed(seed)
    ranks = torch.stack([torch.randperm(num_experts, generator=generator) for _ in range(num_tokens)])
    return (ranks.float() * 0.0625 - num_experts * 0.03).to(dtype=dtype, device=device)


def assert_routes_like_torch(logits, top_k, **options):
    weights, ids = softmax_topk(logits, top_k, **options)
    expected_weights, expected_ids = routers.softmax_topk(logits, top_k, **options)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert torch.equal(ids.long(), expected_ids)
    torch.testing.assert_close(weights, expected_weights, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("num_tokens, num_experts, top_k", [(1, 8, 2), (5, 6, 2), (7, 128, 8), (3, 60, 4),
                                                           (2, 4, 4)])
@pytest.mark.parametrize("renormalize", [False, True])
def test_matches_routers(num_tokens, num_experts, top_k, renormalize):
    assert_routes_like_torch(distinct_logits(num_tokens, num_experts), top_k, renormalize=renormalize)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_weights_rounded_through_the_logits_dtype(dtype):
    logits = distinct_logits(6, 16, dtype=dtype)
    weights, ids = softmax_topk(logits, 4, renormalize=True, weights_in_logits_dtype=True)
    expected_weights, expected_ids = routers.softmax_topk(logits, 4, renormalize=True, weights_in_logits_dtype=True)
    assert torch.equal(ids.long(), expected_ids)
    assert torch.equal(weights, weights.to(dtype).float()), f"weights must hold {dtype} values"
    torch.testing.assert_close(weights, expected_weights, rtol=2**-7, atol=0)  # one bf16 step at most


def test_strided_logits():
    wide = distinct_logits(4, 20)
    assert_routes_like_torch(wide[:, :12], 3, renormalize=True)


def test_ties_go_to_the_lower_expert():
    logits = torch.tensor([[0.0, 2.0, 2.0, 1.0, 2.0]])
    weights, ids = softmax_topk(logits, 2, renormalize=True)
    assert ids.tolist() == [[1, 2]]
    torch.testing.assert_close(weights, torch.tensor([[0.5, 0.5]]))


def test_no_tokens():
    weights, ids = softmax_topk(torch.zeros(0, 8), 2, renormalize=True)
    assert weights.shape == ids.shape == (0, 2)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="top_k must be in"):
        softmax_topk(torch.zeros(2, 8), 9, renormalize=True)
    with pytest.raises(ValueError, match="experts"):
        softmax_topk(torch.zeros(2, 2048), 2, renormalize=True)


@gpu[0]
@gpu[1]
@pytest.mark.parametrize("num_tokens", [1, 300, 8192])
def test_gpu_bf16_qwen3_moe_shape(num_tokens):
    logits = distinct_logits(num_tokens, 128, dtype=torch.bfloat16, device="cuda")
    weights, ids = softmax_topk(logits, 8, renormalize=True, weights_in_logits_dtype=True)
    expected_weights, expected_ids = routers.softmax_topk(logits, 8, renormalize=True, weights_in_logits_dtype=True)
    assert torch.equal(ids.long(), expected_ids)
    torch.testing.assert_close(weights, expected_weights, rtol=2**-7, atol=0)
