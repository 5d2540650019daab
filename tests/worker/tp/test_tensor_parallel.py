"""A model sharded over two CPU ranks (gloo) computes the unsharded model's logits (with fp8
experts: those of the unsharded model holding what the ranks' fp8 rows stand for).

Each rank builds the same tiny random decoder twice, shards one copy, and runs both through
their own `ModelRunner` (plain-torch attention, each its own KV pool): a batched prefill, then
greedy decode steps. The ranks report their largest logit difference and their tokens; the
test asserts on every rank's report.
"""

from __future__ import annotations

import copy
import dataclasses
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from spillway.worker.runner.model_runner import ChunkInput, ModelRunner
from spillway.worker.models import build_model
from spillway.worker.models.cpu_linear import onednn_linear_works, pack_linear_layers
from spillway.worker.models.fp8_experts import quantize_experts
from spillway.worker.models.fp8_linear import dequantize_rows, quantize_rows
from spillway.worker.models.gpu_linear import store_weights_input_major
from spillway.worker.models.layers import TORCH_OPS
from spillway.worker.models.sparse_moe import SparseMoeBlock
from spillway.worker.models.spec import MoeSpec
from spillway.worker.models.tensor_parallel import ShardLayout, shard_model

TOLERANCE = 1e-4
CPU = torch.device("cpu")
WORLD_SIZE = 2
DECODE_STEPS = 8
BLOCK_SIZE = 4
PROMPT_LENGTHS = (3, 9, 14)

# 4 query heads over 2 KV heads (one per rank), q/k norms, an odd vocabulary (a padded shard).
QWEN3 = dict(model_type="qwen3", vocab_size=301, num_attention_heads=4, num_key_value_heads=2)
# One KV head for 2 ranks (replicated), every bias (o_proj's and down_proj's added once), tied.
LLAMA_ONE_KV_HEAD = dict(model_type="llama", vocab_size=300, num_attention_heads=4, num_key_value_heads=1,
                         attention_bias=True, mlp_bias=True, tie_word_embeddings=True)


# Mixtures of experts: Qwen3-MoE with layer 1 dense (a sparse and a dense layer), 4 experts of
# width 32 (16 a rank); Mixtral, 4 experts of width 96.
QWEN3_MOE = dict(model_type="qwen3_moe", vocab_size=301, num_attention_heads=4, num_key_value_heads=2,
                 num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                 mlp_only_layers=[1], decoder_sparse_step=1)
MIXTRAL = dict(model_type="mixtral", vocab_size=300, num_attention_heads=4, num_key_value_heads=2,
               num_local_experts=4, num_experts_per_tok=2, sliding_window=None)


# Each two-rank run: its config and how the sharded model's weights are laid out after sharding.
CASES = {
    "qwen3-split-kv-heads-packed": (QWEN3, "packed"),
    "llama-replicated-kv-head-tied-biases-input-major": (LLAMA_ONE_KV_HEAD, "input-major"),
    "qwen3-moe-packed": (QWEN3_MOE, "packed"),
    "mixtral-input-major": (MIXTRAL, "input-major"),
    "qwen3-moe-fp8-experts": (QWEN3_MOE, "fp8-experts"),
}


def tiny_config(**overrides) -> SimpleNamespace:
    values = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, head_dim=16, rms_norm_eps=1e-5,
                  rope_theta=10000.0, attention_bias=False, mlp_bias=False, tie_word_embeddings=False)
    return SimpleNamespace(**{**values, **overrides})


def random_model(config):
    """Our decoder with every weight random (biases and norm scales too), the same on every rank."""
    model = build_model(config, device=CPU, dtype=torch.float32)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5, generator=generator)
            else:
                param.normal_(0.0, 0.2, generator=generator)
    return model


def greedy_steps(runner: ModelRunner, prompts: list[list[int]]) -> tuple[list[torch.Tensor], list[list[int]]]:
    """Every step's logits and the greedy tokens: one prefill step of all prompts, then decodes."""
    tables = [list(range(i * 8, i * 8 + 8)) for i in range(len(prompts))]  # 32 slots each, disjoint
    sequences = [list(p) for p in prompts]
    chunks = [ChunkInput(p, 0, t) for p, t in zip(prompts, tables)]
    step_logits = []
    for _ in range(DECODE_STEPS):
        logits = runner.execute(chunks).clone()
        step_logits.append(logits)
        for sequence, token in zip(sequences, logits.argmax(-1).tolist()):
            sequence.append(token)
        chunks = [ChunkInput([s[-1]], len(s) - 1, t) for s, t in zip(sequences, tables)]
    return step_logits, [s[len(p):] for s, p in zip(sequences, prompts)]


def experts_as_the_ranks_quantize_them(model) -> None:
    """The unsharded model's experts set to what the ranks' fp8 experts stand for: each gate/up row
    quantized whole (a rank keeps whole rows), each down_proj row per rank, over the rank's columns."""
    for layer in model.model.layers:
        if not isinstance(layer.mlp, SparseMoeBlock):
            continue
        experts = layer.mlp.experts
        with torch.no_grad():
            experts.gate_up_proj.copy_(dequantize_rows(*quantize_rows(experts.gate_up_proj)))
            for columns in experts.down_proj.chunk(WORLD_SIZE, dim=2):  # views: written in place
                columns.copy_(dequantize_rows(*quantize_rows(columns)))


# After sharding: the weights laid out as the CPU path does ("packed" for oneDNN), as the GPU path
# does ("input-major"), or the experts quantized to fp8 per row, each rank its own rows.
RELAYOUTS = {"packed": pack_linear_layers, "input-major": store_weights_input_major, "fp8-experts": quantize_experts}


def rank_report(rank: int, config_values: dict, weights: str) -> dict:
    """`weights`: RELAYOUTS' keys."""
    config = tiny_config(**config_values)
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(config.vocab_size, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]
    runners = []
    for sharded in (False, True):
        model = random_model(config)
        relaid = 0
        if sharded:
            layout = shard_model(model, rank, WORLD_SIZE)
            relaid = RELAYOUTS[weights](model)
        elif weights == "fp8-experts":
            experts_as_the_ranks_quantize_them(model)
        runners.append(ModelRunner(model, num_blocks=32, block_size=BLOCK_SIZE, device=CPU, dtype=torch.float32))
    (reference_logits, reference_tokens), (logits, tokens) = (greedy_steps(r, prompts) for r in runners)
    return dict(
        max_diff=max((a - b).abs().max().item() for a, b in zip(logits, reference_logits)),
        logits_shape=tuple(logits[0].shape),
        tokens=tokens,
        reference_tokens=reference_tokens,
        kv_cache_shape=tuple(runners[1].kv_cache.shape),
        layout=layout,
        relaid=relaid,
    )


def run_rank(rank: int, rendezvous: str, results_dir: str) -> None:
    """Every case in turn, in one process group; each case's report saved apart."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=WORLD_SIZE)
    try:
        for name, (config_values, weights) in CASES.items():
            torch.save(rank_report(rank, config_values, weights), f"{results_dir}/{name}-rank{rank}.pt")
        # Both ranks past their last collective before either tears gloo down: a rank that
        # exits while its peer's gloo threads still run aborts the peer.
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> dict[str, list[dict]]:
    """Each case's reports, rank 0's then rank 1's. One spawn of the two ranks runs every case:
    starting the ranks takes longer than a case's run."""
    results_dir = tmp_path_factory.mktemp("ranks")
    mp.spawn(run_rank, args=(f"file://{results_dir}/rendezvous", str(results_dir)), nprocs=WORLD_SIZE)
    return {name: [torch.load(results_dir / f"{name}-rank{rank}.pt", weights_only=False) for rank in range(WORLD_SIZE)]
            for name in CASES}


@pytest.mark.parametrize(("case", "kv_heads", "first_kv_heads"), [
    ("qwen3-split-kv-heads-packed", 1, [0, 1]),
    ("llama-replicated-kv-head-tied-biases-input-major", 1, [0, 0]),
])
def test_two_ranks_compute_the_unsharded_logits_and_tokens(reports, case, kv_heads, first_kv_heads):
    config_values, weights = CASES[case]
    # Re-laid after sharding: 4 per layer (qkv, o, gate_up, down), and for oneDNN lm_head too.
    if weights == "input-major":
        relaid = 4 * 2
    else:
        relaid = 4 * 2 + 1 if onednn_linear_works(torch.float32) else 0

    for rank, report in enumerate(reports[case]):
        assert report["logits_shape"] == (len(PROMPT_LENGTHS), config_values["vocab_size"])
        assert report["max_diff"] < TOLERANCE, f"rank {rank}"
        assert report["tokens"] == report["reference_tokens"]
        assert len(set(report["tokens"][0])) > 1  # the outputs do not loop on one token
        # Each rank's pool: [blocks, layers, k/v, block_size, its KV heads, head_dim].
        assert report["kv_cache_shape"] == (32, 2, 2, BLOCK_SIZE, kv_heads, 16)
        assert report["layout"].num_heads == 2
        assert report["layout"].first_kv_head == first_kv_heads[rank]
        assert report["relaid"] == relaid


@pytest.mark.parametrize(("case", "dense_layers"), [("qwen3-moe-packed", 1), ("mixtral-input-major", 0)])
def test_two_ranks_compute_the_unsharded_logits_and_tokens_of_a_mixture_of_experts(reports, case, dense_layers):
    config_values, weights = CASES[case]
    # Re-laid after sharding: qkv and o per layer, gate_up and down per dense layer (the routers
    # and experts are no nn.Linear), and for oneDNN lm_head too.
    relaid = 2 * 2 + 2 * dense_layers
    if weights == "packed":
        relaid = relaid + 1 if onednn_linear_works(torch.float32) else 0

    for rank, report in enumerate(reports[case]):
        assert report["max_diff"] < TOLERANCE, f"rank {rank}"
        assert report["tokens"] == report["reference_tokens"]
        assert len(set(report["tokens"][0])) > 1
        assert report["layout"].expert_intermediate_size == (16 if config_values is QWEN3_MOE else 48)
        assert report["relaid"] == relaid


def test_two_ranks_with_fp8_experts_compute_the_logits_of_the_experts_they_quantized(reports):
    """Each rank quantizes its slice of every expert (quantize_experts after the cut): the two
    compute the unsharded model whose experts hold what the ranks' fp8 rows stand for."""
    for rank, report in enumerate(reports["qwen3-moe-fp8-experts"]):
        assert report["relaid"] == 1  # the one sparse layer's experts
        assert report["max_diff"] < TOLERANCE, f"rank {rank}"
        assert report["tokens"] == report["reference_tokens"]
        assert len(set(report["tokens"][0])) > 1


@pytest.mark.parametrize(("kv_heads", "world_size", "first_kv_heads"), [
    (8, 4, [0, 2, 4, 6]),  # split: two heads a rank
    (2, 4, [0, 0, 1, 1]),  # replicated: each head on the two ranks whose query heads read it
    (1, 8, [0] * 8),
])
def test_layout_gives_each_rank_the_kv_heads_its_query_heads_read(kv_heads, world_size, first_kv_heads):
    spec = random_model(tiny_config(model_type="llama", vocab_size=30, num_attention_heads=8,
                                    num_key_value_heads=kv_heads, head_dim=8)).spec
    layouts = [ShardLayout.plan(spec, rank, world_size) for rank in range(world_size)]

    assert [layout.first_kv_head for layout in layouts] == first_kv_heads
    assert {layout.num_kv_heads for layout in layouts} == {max(kv_heads // world_size, 1)}
    group_size = 8 // kv_heads  # query heads per KV head
    for layout in layouts:
        read = {head // group_size for head in range(layout.first_head, layout.first_head + layout.num_heads)}
        assert read == set(range(layout.first_kv_head, layout.first_kv_head + layout.num_kv_heads))
    assert [layout.first_vocab_row for layout in layouts] == [rank * -(-30 // world_size) for rank in range(world_size)]


def test_kv_heads_that_do_not_split_raise_naming_the_sizes():
    model = random_model(tiny_config(model_type="qwen3", vocab_size=64, num_attention_heads=6, num_key_value_heads=3))

    with pytest.raises(ValueError, match=r"tensor parallel size 2 and the model's 3 KV heads do not divide"):
        shard_model(model, rank=0, world_size=2)
    assert model.num_kv_heads == 3 and model.model.layers[0].self_attn.qkv_proj.out_features == (6 + 2 * 3) * 16


def test_query_heads_or_intermediate_size_that_do_not_split_raise():
    odd_heads = random_model(tiny_config(model_type="llama", vocab_size=64, num_attention_heads=3,
                                         num_key_value_heads=1))
    odd_intermediate = random_model(tiny_config(model_type="llama", vocab_size=64, num_attention_heads=4,
                                                num_key_value_heads=2, intermediate_size=90))

    with pytest.raises(ValueError, match=r"tensor parallel size 2 does not divide the model's 3 attention heads"):
        shard_model(odd_heads, rank=1, world_size=2)
    with pytest.raises(ValueError, match=r"tensor parallel size 4 does not divide the model's intermediate size 90"):
        shard_model(odd_intermediate, rank=1, world_size=4)


def test_an_expert_width_that_does_not_split_raises():
    model = random_model(tiny_config(**{**QWEN3_MOE, "moe_intermediate_size": 30}))

    with pytest.raises(ValueError, match=r"tensor parallel size 4 does not divide the model's experts' intermediate "
                                         r"size 30"):
        shard_model(model, rank=0, world_size=4)
    assert model.model.layers[0].mlp.experts.gate_up_proj.shape == (4, 60, 64)


def test_each_rank_holds_a_slice_of_every_expert_and_of_the_shared_experts_and_their_sum_is_the_block():
    """One process, a group of one: each rank's block computes its partial sum (the all-reduce
    adds nothing), and the two ranks' partial sums add up to the whole block's output. The
    block has DeepSeek's shared experts, which no family here has yet."""
    spec = MoeSpec(num_experts=4, top_k=2, expert_intermediate_size=32, norm_topk_prob=True, sparse_layers=(0,),
                   shared_expert_intermediate_size=48)
    generator = torch.Generator().manual_seed(3)
    whole = SparseMoeBlock(64, spec, TORCH_OPS)
    with torch.no_grad():
        for param in whole.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    hidden = torch.randn(9, 64, generator=generator)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        partial_sums = []
        for rank in range(WORLD_SIZE):
            model = random_model(tiny_config(**{**QWEN3_MOE, "num_hidden_layers": 1, "mlp_only_layers": []}))
            model.model.layers[0].mlp = copy.deepcopy(whole)
            model.spec = dataclasses.replace(model.spec, moe=spec)
            layout = shard_model(model, rank, WORLD_SIZE)
            shard = model.model.layers[0].mlp
            assert (layout.expert_intermediate_size, layout.shared_expert_intermediate_size) == (16, 24)
            assert model.spec.moe.shared_expert_intermediate_size == 24
            assert shard.moe.experts.gate_up_proj.shape == (4, 32, 64)
            assert shard.moe.shared_experts.down_proj.weight.shape == (64, 24)
            with torch.no_grad():
                partial_sums.append(shard(hidden))
    finally:
        dist.destroy_process_group()
    with torch.no_grad():
        expected = whole(hidden)
    assert (partial_sums[0] + partial_sums[1] - expected).abs().max() < 1e-5
    assert (partial_sums[0] - expected).abs().max() > 0.1  # each rank holds a part only
