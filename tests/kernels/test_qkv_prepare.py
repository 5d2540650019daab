"""prepare_qkv against its reference, and the reference against the separate kernels' references
(rms_norm, then rotary, then write_kv): odd head counts, rows crossing block boundaries in a
shuffled block table, padded rows, a layer past the first, positions unlike row indices; a
float8 e4m3 cache holding exactly the clamped cast of the rotated k and of v."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch
from kernel_testing import gpu, random_tensor, relative_error, same_bytes, slot_mask

from spillway.kernels.kv_write import write_kv_reference
from spillway.kernels.qkv_prepare import prepare_qkv, prepare_qkv_reference
from spillway.kernels.rmsnorm import rms_norm_reference
from spillway.kernels.rotary import apply_rotary_reference, build_cos_sin_cache
from spillway.worker.models.layers import rotary_inv_freq

EPS = 1e-6
LAYER = 2


@dataclass(slots=True)
class Step:
    """One layer's inputs: a fused qkv, a 3-layer cache, and each row's slot and position."""

    qkv: torch.Tensor
    kv_cache: torch.Tensor
    slot_mapping: torch.Tensor
    positions: torch.Tensor
    cos_cache: torch.Tensor
    sin_cache: torch.Tensor
    num_heads: int
    num_kv_heads: int
    head_dim: int
    q_norm_weight: torch.Tensor | None
    k_norm_weight: torch.Tensor | None

    def args(self) -> tuple:
        return (self.qkv, self.kv_cache, LAYER, self.slot_mapping, self.positions, self.cos_cache, self.sin_cache,
                self.num_heads, self.num_kv_heads, self.head_dim, self.q_norm_weight, self.k_norm_weight, EPS)

    def clone(self) -> Step:
        return replace(self, qkv=self.qkv.clone(), kv_cache=self.kv_cache.clone())


def make_step(num_rows, num_heads, num_kv_heads, head_dim, *, norm=True, padded_rows=(), block_size=8,
              start=5, dtype=torch.float32, device="cpu", seed=0) -> Step:
    """A sequence's rows at positions start.. in shuffled blocks; rows in `padded_rows` get slot -1."""
    device = torch.device(device)
    generator = torch.Generator().manual_seed(seed)
    num_blocks = -(-(start + num_rows) // block_size) + 3
    table = torch.randperm(num_blocks, generator=generator)
    positions = torch.arange(start, start + num_rows)
    slots = table[positions // block_size] * block_size + positions % block_size
    slots[list(padded_rows)] = -1
    width = (num_heads + 2 * num_kv_heads) * head_dim
    cos_cache, sin_cache = build_cos_sin_cache(rotary_inv_freq(head_dim, 10000.0, None), start + num_rows + 7, device)
    weights = [(random_tensor(head_dim, seed=seed + i).abs() + 0.5).to(device=device, dtype=dtype) for i in (3, 4)]
    return Step(
        qkv=random_tensor(num_rows, width, dtype=dtype, device=device, seed=seed + 1) * 2,
        kv_cache=random_tensor(num_blocks, 3, 2, block_size, num_kv_heads, head_dim, dtype=dtype, device=device,
                               seed=seed + 2),
        slot_mapping=slots.to(device),
        positions=positions.to(device),
        cos_cache=cos_cache,
        sin_cache=sin_cache,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        q_norm_weight=weights[0] if norm else None,
        k_norm_weight=weights[1] if norm else None,
    )


def composed_reference(step: Step) -> torch.Tensor:
    """The unfused path: per-head norms, rotary, then write_kv, each by its own reference."""
    num_rows, q_size = step.qkv.shape[0], step.num_heads * step.head_dim
    heads = step.qkv.view(num_rows, -1, step.head_dim)
    q, k, v = heads.split([step.num_heads, step.num_kv_heads, step.num_kv_heads], dim=1)
    if step.q_norm_weight is not None:
        q, k = rms_norm_reference(q, step.q_norm_weight, EPS), rms_norm_reference(k, step.k_norm_weight, EPS)
    q, k = apply_rotary_reference(q, k, step.positions, step.cos_cache, step.sin_cache)
    write_kv_reference(k, v, step.kv_cache, LAYER, step.slot_mapping)
    step.qkv[:, :q_size] = q.reshape(num_rows, -1)
    step.qkv[:, q_size : q_size + k[0].numel()] = k.reshape(num_rows, -1)
    return step.qkv[:, :q_size].view(num_rows, step.num_heads, step.head_dim)


def written_slots(step: Step) -> torch.Tensor:
    """bool, shaped like the cache: the entries this step's k/v may write."""
    return slot_mask(step.kv_cache, LAYER, step.slot_mapping)


SHAPES = [  # rows, q heads, kv heads, head_dim, padded rows
    (1, 5, 1, 32, ()),
    (3, 6, 3, 64, (1,)),
    (17, 5, 1, 64, (0, 16)),
    (17, 6, 3, 32, (4,)),
    (3, 4, 2, 128, (2,)),
]


@pytest.mark.parametrize("norm", [True, False], ids=["norm", "no-norm"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s[:4])))
def test_reference_equals_the_separate_references(shape, norm):
    num_rows, num_heads, num_kv_heads, head_dim, padded = shape
    for dtype, cache_dtype in ((torch.float32, None), (torch.bfloat16, None), (torch.bfloat16, torch.float8_e4m3fn)):
        step = make_step(num_rows, num_heads, num_kv_heads, head_dim, norm=norm, padded_rows=padded, dtype=dtype)
        step.kv_cache = step.kv_cache.to(cache_dtype or dtype)
        expected = step.clone()
        q = prepare_qkv_reference(*step.args())
        expected_q = composed_reference(expected)
        assert torch.equal(q, expected_q)
        assert torch.equal(step.qkv, expected.qkv)
        assert same_bytes(step.kv_cache, expected.kv_cache)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("norm", [True, False], ids=["norm", "no-norm"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s[:4])))
def test_kernel_matches_reference(shape, norm, dtype):
    num_rows, num_heads, num_kv_heads, head_dim, padded = shape
    step = make_step(num_rows, num_heads, num_kv_heads, head_dim, norm=norm, padded_rows=padded, dtype=dtype)
    original_cache = step.kv_cache.clone()
    expected = step.clone()
    expected_q = prepare_qkv_reference(*expected.args())
    q = prepare_qkv(*step.args())

    assert q.shape == (num_rows, num_heads, head_dim) and q.data_ptr() == step.qkv.data_ptr()
    written = written_slots(step)
    assert written.sum() == 2 * (num_rows - len(padded)) * num_kv_heads * head_dim
    assert torch.equal(step.kv_cache[~written], original_cache[~written]), "wrote outside this step's slots"
    v_size = num_kv_heads * head_dim
    assert torch.equal(step.qkv[:, -v_size:], expected.qkv[:, -v_size:]), "v must stay as it was"
    assert torch.equal(step.kv_cache[:, :, 1], expected.kv_cache[:, :, 1]), "v must be stored unchanged"
    if dtype == torch.float32:
        torch.testing.assert_close(step.qkv, expected.qkv, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(step.kv_cache, expected.kv_cache, rtol=1e-5, atol=1e-5)
    else:
        # The interpreter rounds float32 to bf16 toward zero, not to nearest as torch and the
        # GPU do, and the norm rounds twice before the rotation rounds: errors of an ulp or
        # two, all of one sign, so over whole tensors they do not average out.
        assert relative_error(step.qkv, expected.qkv) < 2**-6
        assert relative_error(step.kv_cache[written], expected.kv_cache[written]) < 2**-6
    assert torch.equal(q, step.qkv[:, : num_heads * head_dim].view_as(expected_q))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("norm", [True, False], ids=["norm", "no-norm"])
def test_float8_cache_holds_the_clamped_cast_of_rotated_k_and_of_v(norm, dtype):
    step = make_step(17, 6, 3, 32, norm=norm, padded_rows=(4, 9), dtype=dtype)
    kv_size = 3 * 32
    step.qkv[:, -kv_size:] *= 200  # v beyond 448 in places
    if not norm:
        step.qkv[:, -2 * kv_size:-kv_size] *= 200  # and k, which the norm would bring back
    same_dtype = step.clone()
    step.kv_cache = step.kv_cache.to(torch.float8_e4m3fn)
    original_cache = step.kv_cache.clone()
    original_v = step.qkv[:, -kv_size:].reshape(17, 3, 32).clone()
    reference = step.clone()
    prepare_qkv_reference(*reference.args())
    q = prepare_qkv(*step.args())
    prepare_qkv(*same_dtype.args())

    assert torch.equal(step.qkv, same_dtype.qkv), "q and k in qkv must not depend on the cache's dtype"
    assert q.data_ptr() == step.qkv.data_ptr()
    k = step.qkv[:, -2 * kv_size:-kv_size].reshape(17, 3, 32)
    expected = original_cache.clone()
    write_kv_reference(k, original_v, expected, LAYER, step.slot_mapping)
    assert same_bytes(step.kv_cache, expected)  # and slots of padded rows untouched
    assert (original_v.abs() > 448).any() and not step.kv_cache.float().isnan().any()
    assert step.kv_cache.float().abs().max() == 448
    # The reference's k differs by an ulp of qkv's dtype here and there (see the test above).
    assert same_bytes(step.kv_cache[:, :, 1], reference.kv_cache[:, :, 1])
    assert relative_error(step.kv_cache.float(), reference.kv_cache.float()) < 2**-6


def test_rotated_k_in_qkv_is_what_the_cache_holds():
    step = make_step(3, 6, 3, 32, padded_rows=(1,))
    prepare_qkv(*step.args())
    block_size = step.kv_cache.shape[3]
    k = step.qkv[:, 6 * 32 : 9 * 32].view(3, 3, 32)
    for row in (0, 2):
        slot = int(step.slot_mapping[row])
        assert torch.equal(step.kv_cache[slot // block_size, LAYER, 0, slot % block_size], k[row])


def test_no_rows_is_a_no_op():
    step = make_step(1, 4, 2, 32)
    step.qkv, step.slot_mapping, step.positions = step.qkv[:0], step.slot_mapping[:0], step.positions[:0]
    cache = step.kv_cache.clone()
    assert prepare_qkv(*step.args()).shape == (0, 4, 32)
    assert torch.equal(step.kv_cache, cache)


def test_bad_arguments_are_refused():
    step = make_step(3, 4, 2, 32)
    bad = step.clone()
    bad.qkv = bad.qkv.double()
    with pytest.raises(ValueError, match="qkv must be one of"):
        prepare_qkv(*bad.args())
    bad = step.clone()
    bad.qkv = bad.qkv[:, :-32]
    with pytest.raises(ValueError, match=r"qkv must be \[rows, 256\] for 4 q heads, 2 kv heads of 32"):
        prepare_qkv(*bad.args())
    bad = step.clone()
    bad.slot_mapping = bad.slot_mapping[:2]
    with pytest.raises(ValueError, match="slot_mapping has 2 entries for 3 rows"):
        prepare_qkv(*bad.args())
    bad = step.clone()
    bad.kv_cache = bad.kv_cache.bfloat16()
    with pytest.raises(ValueError, match="kv_cache must be one of"):
        prepare_qkv(*bad.args())
    bad = step.clone()
    bad.k_norm_weight = None
    with pytest.raises(ValueError, match="both q and k norm weights or neither"):
        prepare_qkv(*bad.args())
    bad = step.clone()
    bad.num_kv_heads = 1
    bad.num_heads = 6
    with pytest.raises(ValueError, match="kv_cache must hold 1 kv heads of 32"):
        prepare_qkv(*bad.args())


@gpu[0]
@gpu[1]
@pytest.mark.parametrize("num_rows", [1, 300])
def test_gpu_bf16_qwen3_8b_shape(num_rows):
    step = make_step(num_rows, 32, 8, 128, padded_rows=range(1, num_rows, 7), block_size=16, dtype=torch.bfloat16,
                     device="cuda")
    expected = step.clone()
    prepare_qkv_reference(*expected.args())
    prepare_qkv(*step.args())
    torch.testing.assert_close(step.qkv, expected.qkv, rtol=2**-7, atol=2e-2)
    torch.testing.assert_close(step.kv_cache, expected.kv_cache, rtol=2**-7, atol=2e-2)


@gpu[0]
@gpu[1]
def test_gpu_float8_cache_qwen3_8b_shape():
    step = make_step(300, 32, 8, 128, padded_rows=range(1, 300, 7), block_size=16, dtype=torch.bfloat16,
                     device="cuda")
    step.qkv[:, -8 * 128:] *= 300  # v beyond 448 in places
    step.kv_cache = step.kv_cache.to(torch.float8_e4m3fn)
    original_cache = step.kv_cache.clone()
    original_v = step.qkv[:, -8 * 128:].reshape(300, 8, 128).clone()
    prepare_qkv(*step.args())
    expected = original_cache.clone()
    k = step.qkv[:, 32 * 128 : 40 * 128].reshape(300, 8, 128)
    write_kv_reference(k, original_v, expected, LAYER, step.slot_mapping)
    assert same_bytes(step.kv_cache, expected)
