"""fused_experts against layers.fused_experts (the contract): both paths on awkward shapes through
Triton's interpreter, the alignment slot for slot, bad arguments refused; on the GPU, bf16 at the
Qwen3-30B-A3B shape and a CUDA graph replayed with new inputs."""

from __future__ import annotations

import pytest
import torch
from kernel_testing import gpu, relative_error

from spillway.kernels.fused_moe import fused_experts, fused_experts_reference
from spillway.kernels.moe_align import PairAlignment, align_pairs, align_pairs_reference, pairs_per_chunk
from spillway.kernels.moe_config import MoeConfig
from spillway.worker.models import layers

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


@gpu[0]
@gpu[1]
@pytest.mark.parametrize("num_tokens, config", [(1, GPU_PAIRS), (8, GPU_PAIRS), (8, GPU_GROUPED), (300, GPU_GROUPED),
                                                (300, None)])
def test_gpu_cuda_graph_replays_new_inputs_as_eager_runs_them(qwen3_experts, num_tokens, config):
    w13, w2 = qwen3_experts
    shape = QWEN3_30B_A3B
    first = routed(num_tokens, shape["num_experts"], shape["top_k"], shape["hidden"], dtype=torch.bfloat16,
                   device=CUDA, seed=1)
    hidden, topk_weights, topk_ids = (tensor.clone() for tensor in first)
    fused_experts(hidden, w13, w2, topk_weights, topk_ids, config=config)  # compiled before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured_out = fused_experts(hidden, w13, w2, topk_weights, topk_ids, config=config)
    for seed in (2, 3):
        new_hidden, new_weights, new_ids = routed(num_tokens, shape["num_experts"], shape["top_k"], shape["hidden"],
                                                  dtype=torch.bfloat16, device=CUDA, seed=seed)
        hidden.copy_(new_hidden)
        topk_weights.copy_(new_weights)
        topk_ids.copy_(new_ids)
        graph.replay()
        eager = fused_experts(new_hidden, w13, w2, new_weights, new_ids, config=config)
        torch.cuda.synchronize()
        assert torch.equal(captured_out, eager)
        assert relative_error(eager, fused_experts_reference(new_hidden, w13, w2, new_weights, new_ids)) < 6e-3
