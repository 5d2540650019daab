"""fused_experts against layers.fused_experts (the contract): both paths on awkward shapes through
Triton's interpreter, the alignment slot for slot, bad arguments refused; fp8 weights with row
scales against the dequantized reference; on the GPU, bf16 and fp8 weights at the Qwen3-30B-A3B
shape and a CUDA graph replayed with new inputs."""

from __future__ import annotations

import pytest
import torch
from kernel_testing import gpu, relative_error

from spillway.kernels.fused_moe import fused_experts, fused_experts_reference
from spillway.kernels.moe_align import PairAlignment, align_pairs, align_pairs_reference, pairs_per_chunk
from spillway.kernels.moe_config import MoeConfig
from spillway.worker.models import layers
from spillway.worker.models.fp8_linear import quantize_rows

# Small tiles, so that H and I below span several tiles and end in partial ones.
PAIRS = MoeConfig("pairs", block_size_n=32, block_size_k=32)
GROUPED = MoeConfig("grouped", block_size_m=16, block_size_n=16, block_size_k=32)
PATHS = {"pairs": PAIRS, "grouped": GROUPED}


def expert_weights(num_experts: int, hidden: int, intermediate: int, dtype=torch.float32, device="cpu", seed=0):
    generator = torch.Generator().manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * intermediate, hidden, generator=generator) * hidden**-0.5
    w2 = torch.randn(num_experts, hidden, intermediate, generator=generator) * intermediate**-0.5
    return w13.to(device=device, dtype=dtype), w2.to(device=device, dtype=dtype)


def routed(num_tokens: int, num_experts: int, top_k: int, hidden: int, dtype=torch.float32, device="cpu", seed=1):
    """Hidden rows and softmax top-k routing over random logits: (hidden, topk_weights, topk_ids)."""
    generator = torch.Generator().manual_seed(seed)
    rows = torch.randn(num_tokens, hidden, generator=generator)
    weights, ids = torch.softmax(torch.randn(num_tokens, num_experts, generator=generator), -1).topk(top_k, -1)
    return rows.to(device=device, dtype=dtype), weights.to(device), ids.to(device)


def assert_matches_layers(hidden, w13, w2, topk_weights, topk_ids, config):
    out = fused_experts(hidden, w13, w2, topk_weights, topk_ids, config=config)
    expected = layers.fused_experts(hidden, w13, w2, topk_weights, topk_ids)
    assert out.shape == expected.shape and out.dtype == hidden.dtype
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


# (T, E, K, H, I): H, I off the tiles; 260 x 2 pairs take the alignment's chunked launches.
SHAPES = [(1, 1, 1, 40, 24), (3, 5, 2, 72, 40), (17, 8, 3, 33, 20), (40, 3, 3, 64, 48), (40, 8, 2, 50, 36)]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}-E{}-K{}-H{}-I{}".format(*s))
def test_matches_layers_on_awkward_shapes(shape, path):
    num_tokens, num_experts, top_k, hidden, intermediate = shape
    w13, w2 = expert_weights(num_experts, hidden, intermediate)
    assert_matches_layers(*_split(routed(num_tokens, num_experts, top_k, hidden), w13, w2), PATHS[path])


def _split(routing, w13, w2):
    hidden, topk_weights, topk_ids = routing
    return hidden, w13, w2, topk_weights, topk_ids


def test_many_pairs_take_the_chunked_alignment():
    w13, w2 = expert_weights(6, 32, 24)
    assert_matches_layers(*_split(routed(260, 6, 2, 32), w13, w2), GROUPED)


@pytest.mark.parametrize("path", PATHS)
def test_one_expert_takes_every_token_and_others_none(path):
    w13, w2 = expert_weights(6, 40, 24)
    hidden, topk_weights, _ = routed(21, 6, 2, 40)
    topk_ids = torch.tensor([[4, 1]] * 21)  # experts 0, 2, 3 and 5 unused
    assert_matches_layers(hidden, w13, w2, topk_weights, topk_ids, PATHS[path])


@pytest.mark.parametrize("path", PATHS)
def test_unchosen_experts_are_never_read(path):
    w13, w2 = expert_weights(7, 40, 24)
    hidden, topk_weights, _ = routed(6, 7, 2, 40)
    topk_ids = torch.tensor([[5, 1], [1, 5], [3, 5], [5, 3], [1, 3], [3, 1]])
    expected = layers.fused_experts(hidden, w13, w2, topk_weights, topk_ids)
    for unchosen in (0, 2, 4, 6):  # NaN anywhere a kernel reads them would reach the output
        w13[unchosen] = float("nan")
        w2[unchosen] = float("nan")
    out = fused_experts(hidden, w13, w2, topk_weights, topk_ids, config=PATHS[path])
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("path", PATHS)
def test_repeated_ids_across_and_within_tokens(path):
    w13, w2 = expert_weights(4, 40, 24)
    hidden, topk_weights, _ = routed(5, 4, 3, 40)
    topk_ids = torch.tensor([[2, 0, 2], [0, 2, 3], [3, 3, 3], [2, 0, 1], [0, 0, 2]], dtype=torch.int32)
    assert_matches_layers(hidden, w13, w2, topk_weights, topk_ids, PATHS[path])


@pytest.mark.parametrize("path", PATHS)
def test_strided_inputs(path):
    w13, w2 = expert_weights(5, 36, 20)
    wide, topk_weights, topk_ids = routed(9, 5, 2, 50)
    hidden = wide[:, 3:39]  # rows 50 apart
    ids_t = topk_ids.t().contiguous().t()  # [T, K] with strides (1, T)
    assert_matches_layers(hidden, w13, w2, topk_weights.t().contiguous().t(), ids_t, PATHS[path])


@pytest.mark.parametrize("path", [*PATHS, "default"])
def test_no_tokens_give_an_empty_result(path):
    w13, w2 = expert_weights(3, 40, 24)
    out = fused_experts(torch.zeros(0, 40), w13, w2, torch.zeros(0, 2), torch.zeros(0, 2, dtype=torch.int64),
                        config=PATHS.get(path))
    assert out.shape == (0, 40) and out.dtype == torch.float32


@pytest.mark.parametrize("num_tokens, path", [(2, "pairs"), (30, "grouped")])
def test_the_default_config_picks_a_path_by_pairs_per_expert(num_tokens, path, monkeypatch):
    import spillway.kernels.fused_moe as fused_moe

    taken = []

    def recording(name, launch):
        def launch_and_record(*args):
            taken.append(name)
            return launch(*args)
        return launch_and_record

    monkeypatch.setattr(fused_moe, "pair_experts", recording("pairs", fused_moe.pair_experts))
    monkeypatch.setattr(fused_moe, "grouped_experts", recording("grouped", fused_moe.grouped_experts))
    w13, w2 = expert_weights(8, 40, 24)
    assert_matches_layers(*_split(routed(num_tokens, 8, 2, 40), w13, w2), None)  # 0.5 or 7.5 pairs an expert
    assert taken == [path]


@pytest.mark.parametrize("path", PATHS)
def test_float16_against_the_float32_reference(path):
    # float16, not bfloat16: Triton's interpreter multiplies bf16 tiles on their raw bits.
    w13, w2 = expert_weights(5, 48, 40, dtype=torch.float16)
    hidden, topk_weights, topk_ids = routed(11, 5, 2, 48, dtype=torch.float16)
    out = fused_experts(hidden, w13, w2, topk_weights.half(), topk_ids, config=PATHS[path])
    assert out.dtype == torch.float16
    assert relative_error(out, fused_experts_reference(hidden, w13, w2, topk_weights, topk_ids)) < 2e-3


def test_the_reference_equals_layers_in_float32():
    w13, w2 = expert_weights(4, 24, 16)
    hidden, topk_weights, topk_ids = routed(7, 4, 2, 24)
    torch.testing.assert_close(fused_experts_reference(hidden, w13, w2, topk_weights, topk_ids),
                               layers.fused_experts(hidden, w13, w2, topk_weights, topk_ids), rtol=1e-5, atol=1e-6)


def test_alignment_of_the_docstring_example():
    alignment = align_pairs(torch.tensor([[3, 1], [3, 0]]), num_experts=4, block_size_m=4)
    padding = 4
    assert alignment.sorted_pairs.tolist() == [3, padding, padding, padding, 1, padding, padding, padding,
                                               0, 2, padding, padding, padding, padding, padding, padding]
    assert alignment.block_experts.tolist() == [0, 1, 3, -1]
    assert alignment.num_padded.tolist() == [12]


def test_alignment_of_no_pairs_is_empty():
    alignment = align_pairs(torch.zeros(0, 2, dtype=torch.int64), num_experts=4, block_size_m=16)
    assert alignment.sorted_pairs.numel() == alignment.block_experts.numel() == 0
    assert alignment.num_padded.tolist() == [0]


def _assert_same_alignment(got: PairAlignment, expected: PairAlignment) -> None:
    assert got.sorted_pairs.tolist() == expected.sorted_pairs.tolist()
    assert got.block_experts.tolist() == expected.block_experts.tolist()
    assert got.num_padded.tolist() == expected.num_padded.tolist()


@pytest.mark.parametrize("pairs_per_program", [512, 7, None], ids=["one-program", "chunks-of-7", "by-device"])
@pytest.mark.parametrize("num_tokens, top_k, num_experts, block_size_m", [
    (1, 1, 1, 16), (3, 2, 5, 4), (17, 3, 8, 16), (40, 2, 8, 16), (40, 3, 3, 2), (5, 2, 300, 16), (64, 8, 128, 16),
])
def test_alignment_slot_for_slot(num_tokens, top_k, num_experts, block_size_m, pairs_per_program):
    generator = torch.Generator().manual_seed(num_tokens * 100 + top_k)
    topk_ids = torch.randint(0, num_experts, (num_tokens, top_k), generator=generator, dtype=torch.int32)
    got = align_pairs(topk_ids, num_experts, block_size_m, pairs_per_program=pairs_per_program)
    _assert_same_alignment(got, align_pairs_reference(topk_ids, num_experts, block_size_m))


@pytest.mark.parametrize("num_pairs, sub, num_programs, expected", [
    (1, 64, 132, 64),        # one piece: one program
    (64, 64, 132, 64),
    (1536, 64, 132, 64),     # 24 pieces side by side
    (65536, 64, 132, 512),   # 1,024 pieces over 132 programs: 8 each
    (65536, 64, 8, 8192),
    (0, 64, 8, 64),
])
def test_pairs_per_chunk_fills_the_programs_in_whole_pieces(num_pairs, sub, num_programs, expected):
    assert pairs_per_chunk(num_pairs, sub, num_programs) == expected


def test_alignment_of_strided_ids_with_every_pair_on_one_expert():
    topk_ids = torch.full((2, 30), 2).t()  # [30, 2], strides (1, 30)
    got = align_pairs(topk_ids, 3, 16, pairs_per_program=16)
    assert got.sorted_pairs[:60].tolist() == list(range(60)) and got.num_padded.tolist() == [64]
    assert got.block_experts.tolist() == [2, 2, 2, 2, -1, -1, -1]  # 60 + 3 * 15 slots, rounded up to blocks
    _assert_same_alignment(got, align_pairs_reference(topk_ids, 3, 16))


def _arguments(**changes):
    w13, w2 = expert_weights(4, 40, 24)
    hidden, topk_weights, topk_ids = routed(3, 4, 2, 40)
    arguments = dict(hidden=hidden, w13=w13, w2=w2, topk_weights=topk_weights, topk_ids=topk_ids)
    return {**arguments, **changes}


@pytest.mark.parametrize("changes, message", [
    (dict(hidden=torch.zeros(40)), "hidden must have 2 dims"),
    (dict(hidden=torch.zeros(3, 40, dtype=torch.int32)), "hidden must be one of"),
    (dict(w13=torch.zeros(4, 48, 40, dtype=torch.float16)), "w13 must be one of"),
    (dict(w13=torch.zeros(4, 47, 40)), "even, positive 2I"),
    (dict(w13=torch.zeros(4, 48, 41)), "H = 41"),
    (dict(w2=torch.zeros(4, 40, 23)), r"w2 must be \[E, H, I\] = \[4, 40, 24\]"),
    (dict(w2=torch.zeros(4, 24, 40).transpose(1, 2)), "w2 needs a contiguous last dim"),
    (dict(topk_ids=torch.zeros(2, 2, dtype=torch.int64)), "topk_ids must be"),
    (dict(topk_ids=torch.zeros(3, 2)), "topk_ids must be one of"),
    (dict(topk_weights=torch.zeros(3, 3)), "differs from topk_ids'"),
    (dict(topk_weights=torch.zeros(3, 2, dtype=torch.float16)), "topk_weights must be one of"),
    (dict(topk_ids=torch.tensor([[0, 1], [2, 4], [3, 0]])), r"expert ids must lie in \[0, 4\), got 0..4"),
    (dict(topk_ids=torch.tensor([[0, 1], [-1, 2], [3, 0]])), r"expert ids must lie in \[0, 4\)"),
])
def test_bad_arguments_are_refused(changes, message):
    with pytest.raises(ValueError, match=message):
        fused_experts(**_arguments(**changes))


# FP8 weights: float8 e4m3fn with a float32 scale per output row of each expert.

def fp8_expert_weights(num_experts: int, hidden: int, intermediate: int, device="cpu", seed=0):
    """(w13, w13_scale, w2, w2_scale) quantized by rows as fp8_linear.quantize_rows does, from
    weights whose rows span 2^-4..2^4 in magnitude: every row's scale is its own, so a scale read
    from another row, another expert or the other half of w13 is far off."""
    generator = torch.Generator().manual_seed(seed)
    w13, w2 = expert_weights(num_experts, hidden, intermediate, seed=seed)
    w13 = w13 * 2.0 ** torch.empty(num_experts, 2 * intermediate, 1).uniform_(-4, 4, generator=generator)
    w2 = w2 * 2.0 ** torch.empty(num_experts, hidden, 1).uniform_(-4, 4, generator=generator)
    (w13_q, w13_scale), (w2_q, w2_scale) = quantize_rows(w13), quantize_rows(w2)
    return tuple(tensor.to(device) for tensor in (w13_q, w13_scale, w2_q, w2_scale))


def tolerance(dtype: torch.dtype) -> float:
    """The relative error (in norm) the kernels may show against the float32 reference: their
    roundings to hidden's dtype (the silu * up rows, a choice's output on the grouped path, the
    result), within 2 ulps together, and float32 sums taken in another order."""
    return 2 * torch.finfo(dtype).eps + 32 * torch.finfo(torch.float32).eps


# Triton's interpreter multiplies bf16 tiles on their raw bits: the grouped path's tensor-core
# products take float16 here, bf16 on the GPU below.
FP8_CASES = [("pairs", torch.float32), ("pairs", torch.bfloat16), ("grouped", torch.float32),
             ("grouped", torch.float16)]
# (T, E, K, H, I): reduction tails off the 32-wide tiles, whole tiles (64, 32), one token-expert pair.
FP8_SHAPES = [(1, 1, 1, 40, 24), (3, 5, 2, 72, 40), (17, 8, 3, 33, 20), (9, 4, 2, 64, 32), (24, 8, 2, 50, 36)]


@pytest.mark.parametrize("path, dtype", FP8_CASES, ids=lambda case: str(case).removeprefix("torch."))
@pytest.mark.parametrize("shape", FP8_SHAPES, ids=lambda s: "T{}-E{}-K{}-H{}-I{}".format(*s))
def test_fp8_weights_match_the_dequantized_reference(shape, path, dtype):
    num_tokens, num_experts, top_k, hidden_size, intermediate = shape
    w13, w13_scale, w2, w2_scale = fp8_expert_weights(num_experts, hidden_size, intermediate)
    hidden, topk_weights, topk_ids = routed(num_tokens, num_experts, top_k, hidden_size, dtype=dtype)

    out = fused_experts(hidden, w13, w2, topk_weights, topk_ids, config=PATHS[path], w13_scale=w13_scale,
                        w2_scale=w2_scale)
    assert out.shape == hidden.shape and out.dtype == dtype
    assert relative_error(out, fused_experts_reference(hidden, w13, w2, topk_weights, topk_ids, w13_scale,
                                                       w2_scale)) < tolerance(dtype)


@pytest.mark.parametrize("path", PATHS)
def test_fp8_weights_match_layers_in_float32(path):
    """The CPU path (layers.fused_experts, each chosen expert dequantized) is the same arithmetic."""
    w13, w13_scale, w2, w2_scale = fp8_expert_weights(6, 56, 40)
    hidden, topk_weights, topk_ids = routed(13, 6, 3, 56)
    out = fused_experts(hidden, w13, w2, topk_weights, topk_ids, config=PATHS[path], w13_scale=w13_scale,
                        w2_scale=w2_scale)
    expected = layers.fused_experts(hidden, w13, w2, topk_weights, topk_ids, w13_scale=w13_scale, w2_scale=w2_scale)
    assert relative_error(out, expected) < tolerance(torch.float32)


def test_a_misplaced_scale_is_far_beyond_the_tolerance():
    """What the fp8 tests' tolerance tells apart: each way of reading a wrong scale (the other half
    of w13, a neighbouring row, another expert, none) moves the reference by more than three times
    the loosest of it (bf16's). Least of all the gate's and up's scales traded (5.7% here): where
    the gate is large, silu(g r) (u / r) is about g u."""
    w13, w13_scale, w2, w2_scale = fp8_expert_weights(5, 48, 32)
    hidden, topk_weights, topk_ids = routed(11, 5, 2, 48)
    expected = fused_experts_reference(hidden, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale)
    misplaced = [(w13_scale.roll(32, dims=1), w2_scale), (w13_scale.roll(1, dims=1), w2_scale),
                 (w13_scale, w2_scale.roll(1, dims=1)), (w13_scale.roll(1, dims=0), w2_scale),
                 (w13_scale, w2_scale.roll(1, dims=0)), (torch.ones_like(w13_scale), w2_scale)]
    for wrong_w13_scale, wrong_w2_scale in misplaced:
        wrong = fused_experts_reference(hidden, w13, w2, topk_weights, topk_ids, wrong_w13_scale, wrong_w2_scale)
        assert relative_error(wrong, expected) > 3 * tolerance(torch.bfloat16)


@pytest.mark.parametrize("path", PATHS)
def test_fp8_weights_and_scales_of_unchosen_experts_are_never_read(path):
    w13, w13_scale, w2, w2_scale = fp8_expert_weights(7, 40, 24)
    hidden, topk_weights, _ = routed(6, 7, 2, 40)
    topk_ids = torch.tensor([[5, 1], [1, 5], [3, 5], [5, 3], [1, 3], [3, 1]])
    expected = fused_experts_reference(hidden, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale)
    nan = torch.tensor(float("nan")).to(w13.dtype).view(torch.uint8)
    for unchosen in (0, 2, 4, 6):  # NaN anywhere a kernel reads them would reach the output
        w13.view(torch.uint8)[unchosen] = nan
        w2.view(torch.uint8)[unchosen] = nan
        w13_scale[unchosen] = float("nan")
        w2_scale[unchosen] = float("nan")
    out = fused_experts(hidden, w13, w2, topk_weights, topk_ids, config=PATHS[path], w13_scale=w13_scale,
                        w2_scale=w2_scale)
    assert relative_error(out, expected) < tolerance(torch.float32)


def test_fp8_weights_look_up_the_tiles_tuned_for_fp8_experts(monkeypatch):
    import spillway.kernels.fused_moe as fused_moe

    asked = []
    real_config_for = fused_moe.config_for
    monkeypatch.setattr(fused_moe, "config_for", lambda *args, **kwargs: asked.append(kwargs) or
                        real_config_for(*args, **kwargs))
    w13, w13_scale, w2, w2_scale = fp8_expert_weights(4, 40, 24)
    hidden, topk_weights, topk_ids = routed(3, 4, 2, 40)
    out = fused_experts(hidden, w13, w2, topk_weights, topk_ids, w13_scale=w13_scale, w2_scale=w2_scale)
    assert [kwargs["weight_dtype"] for kwargs in asked] == [torch.float8_e4m3fn]
    assert relative_error(out, fused_experts_reference(hidden, w13, w2, topk_weights, topk_ids, w13_scale,
                                                       w2_scale)) < tolerance(torch.float32)


def _fp8_arguments(**changes):
    w13, w13_scale, w2, w2_scale = fp8_expert_weights(4, 40, 24)
    hidden, topk_weights, topk_ids = routed(3, 4, 2, 40)
    arguments = dict(hidden=hidden, w13=w13, w2=w2, topk_weights=topk_weights, topk_ids=topk_ids,
                     w13_scale=w13_scale, w2_scale=w2_scale)
    return {**arguments, **changes}


@pytest.mark.parametrize("changes, message", [
    (dict(w13_scale=None), r"w13 is float8_e4m3fn: w13_scale, float32 \[4, 48\] .* is required"),
    (dict(w2_scale=None), r"w2 is float8_e4m3fn: w2_scale, float32 \[4, 40\]"),
    (dict(w13_scale=torch.ones(4, 24)), r"w13_scale must be \[E, rows of w13\] = \[4, 48\], got \[4, 24\]"),
    (dict(w2_scale=torch.ones(4, 40, 1)), "w2_scale must have 2 dims"),
    (dict(w2_scale=torch.ones(4, 40, dtype=torch.bfloat16)), "w2_scale must be one of"),
    (dict(w13_scale=torch.ones(48, 4).t()), "w13_scale needs a contiguous last dim"),
    (dict(w2=torch.zeros(4, 40, 24)), "w13 is torch.float8_e4m3fn and w2 torch.float32: both must be"),
    (dict(w13=torch.zeros(4, 48, 40), w2=torch.zeros(4, 40, 24)),
     "w13_scale is given, but w13 is torch.float32: scales go with float8_e4m3fn weights only"),
    (dict(w13=torch.zeros(4, 48, 40, dtype=torch.float8_e5m2)), "w13 must be one of"),
])
def test_bad_fp8_arguments_are_refused(changes, message):
    with pytest.raises(ValueError, match=message):
        fused_experts(**_fp8_arguments(**changes))


def test_bad_configs_are_refused():
    with pytest.raises(ValueError, match="tensor-core products"):
        MoeConfig("grouped", block_size_m=8)
    with pytest.raises(ValueError, match="power of two"):
        MoeConfig("pairs", block_size_n=24)
    with pytest.raises(ValueError, match="path must be one of"):
        MoeConfig("dense")


CUDA = torch.device("cuda")
QWEN3_30B_A3B = dict(num_experts=128, hidden=2048, intermediate=768, top_k=8)
GPU_PAIRS = MoeConfig("pairs", block_size_n=32, block_size_k=256, num_stages=2)
GPU_GROUPED = MoeConfig("grouped", block_size_m=64, block_size_n=128, block_size_k=64, group_size_m=8, num_warps=4)


@pytest.fixture(scope="module")
def qwen3_experts():
    shape = QWEN3_30B_A3B
    return expert_weights(shape["num_experts"], shape["hidden"], shape["intermediate"], dtype=torch.bfloat16,
                          device=CUDA)


@gpu[0]
@gpu[1]
@pytest.mark.parametrize("config", [None, GPU_PAIRS, GPU_GROUPED], ids=["tuned-or-default", "pairs", "grouped"])
@pytest.mark.parametrize("num_tokens", [1, 7, 256, 3000])
def test_gpu_bf16_at_the_qwen3_30b_a3b_shape(qwen3_experts, num_tokens, config):
    w13, w2 = qwen3_experts
    shape = QWEN3_30B_A3B
    hidden, topk_weights, topk_ids = routed(num_tokens, shape["num_experts"], shape["top_k"], shape["hidden"],
                                            dtype=torch.bfloat16, device=CUDA, seed=num_tokens)
    out = fused_experts(hidden, w13, w2, topk_weights, topk_ids, config=config)
    expected = layers.fused_experts(hidden, w13, w2, topk_weights, topk_ids)
    assert out.dtype == torch.bfloat16 and out.shape == expected.shape
    # layers.py rounds to bf16 after every operation, the kernel keeps float32 but for two roundings.
    assert relative_error(out, expected) < 1.5e-2
    assert relative_error(out, fused_experts_reference(hidden, w13, w2, topk_weights, topk_ids)) < 6e-3


@pytest.fixture(scope="module")
def qwen3_fp8_experts(qwen3_experts):
    """The bf16 experts quantized per row on the GPU: (w13, w13_scale, w2, w2_scale)."""
    (w13, w13_scale), (w2, w2_scale) = (quantize_rows(weight) for weight in qwen3_experts)
    return w13, w13_scale, w2, w2_scale


@gpu[0]
@gpu[1]
@pytest.mark.parametrize("config", [None, GPU_PAIRS, GPU_GROUPED], ids=["tuned-or-default", "pairs", "grouped"])
@pytest.mark.parametrize("num_tokens", [1, 7, 256, 3000])
def test_gpu_fp8_weights_at_the_qwen3_30b_a3b_shape(qwen3_experts, qwen3_fp8_experts, num_tokens, config):
    w13, w13_scale, w2, w2_scale = qwen3_fp8_experts
    shape = QWEN3_30B_A3B
    hidden, topk_weights, topk_ids = routed(num_tokens, shape["num_experts"], shape["top_k"], shape["hidden"],
                                            dtype=torch.bfloat16, device=CUDA, seed=num_tokens)
    scales = dict(w13_scale=w13_scale, w2_scale=w2_scale)
    out = fused_experts(hidden, w13, w2, topk_weights, topk_ids, config=config, **scales)
    assert out.dtype == torch.bfloat16 and out.shape == hidden.shape
    expected = fused_experts_reference(hidden, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale)
    assert relative_error(out, expected) < tolerance(torch.bfloat16)
    # layers.py dequantizes each expert to bf16 and rounds after every operation.
    assert relative_error(out, layers.fused_experts(hidden, w13, w2, topk_weights, topk_ids, **scales)) < 1.5e-2
    # Against the unquantized experts, fp8's rounding of the weights: 0.035-0.047 at the CPU tests' shapes.
    unquantized = fused_experts_reference(hidden, *qwen3_experts, topk_weights, topk_ids)
    assert relative_error(out, unquantized) < 0.1


@gpu[0]
@gpu[1]
@pytest.mark.parametrize("weights", ["bf16", "fp8"])
@pytest.mark.parametrize("num_tokens, config", [(1, GPU_PAIRS), (8, GPU_PAIRS), (8, GPU_GROUPED), (300, GPU_GROUPED),
                                                (300, None)])
def test_gpu_cuda_graph_replays_new_inputs_as_eager_runs_them(request, num_tokens, config, weights):
    """No host sync in a call (a capture would fail on one), with either weights."""
    if weights == "fp8":
        w13, w13_scale, w2, w2_scale = request.getfixturevalue("qwen3_fp8_experts")
        scales = dict(w13_scale=w13_scale, w2_scale=w2_scale)
    else:
        (w13, w2), scales = request.getfixturevalue("qwen3_experts"), {}
    arguments = dict(config=config, **scales)
    shape = QWEN3_30B_A3B
    first = routed(num_tokens, shape["num_experts"], shape["top_k"], shape["hidden"], dtype=torch.bfloat16,
                   device=CUDA, seed=1)
    hidden, topk_weights, topk_ids = (tensor.clone() for tensor in first)
    fused_experts(hidden, w13, w2, topk_weights, topk_ids, **arguments)  # compiled before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured_out = fused_experts(hidden, w13, w2, topk_weights, topk_ids, **arguments)
    for seed in (2, 3):
        new_hidden, new_weights, new_ids = routed(num_tokens, shape["num_experts"], shape["top_k"], shape["hidden"],
                                                  dtype=torch.bfloat16, device=CUDA, seed=seed)
        hidden.copy_(new_hidden)
        topk_weights.copy_(new_weights)
        topk_ids.copy_(new_ids)
        graph.replay()
        eager = fused_experts(new_hidden, w13, w2, new_weights, new_ids, **arguments)
        torch.cuda.synchronize()
        assert torch.equal(captured_out, eager)
        expected = fused_experts_reference(new_hidden, w13, w2, new_weights, new_ids, scales.get("w13_scale"),
                                           scales.get("w2_scale"))
        assert relative_error(eager, expected) < 6e-3
