"""FP8 experts (`--quantization fp8` on a mixture of experts): every expert stack quantized per
output row after loading, on the CPU the same arithmetic as the dequantized experts, near the
unquantized model, and served by the engine; tiny random Qwen3-MoE and Mixtral checkpoints."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from tiny_models import save_tiny_mixtral, save_tiny_qwen3_moe

from spillway.gateway import LLM, SamplingParams
from spillway.protocol.local import model_files
from spillway.tools.bench.engine.fp8_accuracy import compare_logits, teacher_forced_logits
from spillway.worker.models.fp8_experts import Fp8Experts, quantize_experts
from spillway.worker.models.fp8_linear import FP8_DTYPE, FP8_MAX, Fp8Linear
from spillway.worker.models.mlp import MLP
from spillway.worker.models.sparse_moe import Experts, SparseMoeBlock
from spillway.worker.runner.executor import load_model

CPU = torch.device("cpu")
FAMILIES = {"qwen3_moe": save_tiny_qwen3_moe, "mixtral": save_tiny_mixtral}
# e4m3 rounding moves a normal value by at most 2^-4 of it, a subnormal one by 2^-10 of the row's scale.
RELATIVE_STEP, SUBNORMAL_STEP = 2.0 ** -4, 2.0 ** -10


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoint(request, tmp_path_factory):
    """(files, hf_config) of a tiny random checkpoint of the family."""
    files = model_files.resolve_model(FAMILIES[request.param](tmp_path_factory.mktemp(request.param)))
    return files, model_files.load_config(files)


def load(checkpoint, quantization: str | None = None) -> nn.Module:
    files, hf_config = checkpoint
    return load_model(hf_config, files, device=CPU, dtype=torch.float32, seed=0, quantization=quantization)


def sparse_blocks(model: nn.Module) -> list[SparseMoeBlock]:
    return [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, SparseMoeBlock)]


def with_experts_dequantized(model: nn.Module) -> nn.Module:
    """`model` with each `Fp8Experts` replaced by plain `Experts` holding its dequantized weights."""
    for block in sparse_blocks(model):
        gate_up, down = block.experts.dequantized(torch.float32)
        experts = Experts(gate_up.shape[2], model.spec.moe, block.experts.ops)
        experts.gate_up_proj = nn.Parameter(gate_up, requires_grad=False)
        experts.down_proj = nn.Parameter(down, requires_grad=False)
        block.experts = experts
    return model


def prompt(seed: int, length: int = 96) -> list[int]:
    return torch.randint(2, 384, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def logits(model: nn.Module, token_ids: list[int]) -> torch.Tensor:
    return teacher_forced_logits(model, token_ids, device=CPU, dtype=torch.float32)


def test_every_expert_stack_loads_quantized_per_output_row(checkpoint):
    plain, fp8 = load(checkpoint), load(checkpoint, "fp8")
    blocks, plain_blocks = sparse_blocks(fp8), sparse_blocks(plain)
    assert len(blocks) == 2 and all(type(block.experts) is Fp8Experts for block in blocks)
    for block, plain_block in zip(blocks, plain_blocks):
        experts, unquantized = block.experts, plain_block.experts
        num_experts, two_width, hidden = unquantized.gate_up_proj.shape
        assert experts.gate_up_proj.dtype == experts.down_proj.dtype == FP8_DTYPE
        assert experts.gate_up_proj.shape == (num_experts, two_width, hidden)
        assert experts.down_proj.shape == unquantized.down_proj.shape
        assert experts.gate_up_proj_scale.shape == (num_experts, two_width)
        assert experts.down_proj_scale.shape == (num_experts, hidden)
        for name in ("gate_up_proj", "down_proj"):
            weight, scale = getattr(unquantized, name).detach(), getattr(experts, f"{name}_scale")
            assert scale.dtype == torch.float32
            torch.testing.assert_close(scale, weight.abs().amax(-1) / FP8_MAX)  # each output row its own
            dequantized = dict(zip(("gate_up_proj", "down_proj"), experts.dequantized()))[name]
            bound = RELATIVE_STEP * weight.abs() + SUBNORMAL_STEP * scale[..., None]
            assert ((dequantized - weight).abs() <= bound).all(), name
        assert block.gate.weight.dtype == torch.float32  # the router stays as it is
        assert type(block.experts) is Fp8Experts and block.shared_experts is None
    dense = [layer.mlp for layer in fp8.model.layers if isinstance(layer.mlp, MLP)]
    assert all(type(mlp.down_proj) is Fp8Linear for mlp in dense)  # Qwen3-MoE's layer 1
    assert quantize_experts(fp8) == 0  # nothing left to quantize


def test_fp8_experts_compute_what_their_dequantized_weights_do(checkpoint):
    """On the CPU each chosen expert is dequantized as it runs (layers.fused_experts): the logits
    of the model whose experts hold the dequantized weights, everything else the same FP8 model."""
    fp8 = load(checkpoint, "fp8")
    token_ids = prompt(0)
    quantized = logits(fp8, token_ids)
    torch.testing.assert_close(quantized, logits(with_experts_dequantized(fp8), token_ids), rtol=1e-5, atol=1e-5)


def test_fp8_experts_stay_near_the_unquantized_model(checkpoint):
    """Only the experts quantized (weight-only): measured 0.073-0.092 relative error of the logits,
    mean KL 0.008-0.012 nats and top-1 agreement 0.84-0.95 over 3 x 120 positions of these random
    models (flat distributions: median margin 0.3-0.45 on a logit spread of 1.7). Bounds at about
    twice the error; a scale lost or misplaced is off by ~1."""
    plain = load(checkpoint)
    experts_only = load(checkpoint)
    assert quantize_experts(experts_only) == 2
    for seed in (1, 2):
        token_ids = prompt(seed)
        exact, quantized = logits(plain, token_ids), logits(experts_only, token_ids)
        agreement = compare_logits(exact, quantized)
        assert (quantized - exact).norm() / exact.norm() < 0.2
        assert agreement.mean_kl < 0.03 and agreement.top1_agreement >= 0.75, agreement


def greedy(model: nn.Module, token_ids: list[int], new_tokens: int) -> list[int]:
    sequence = list(token_ids)
    for _ in range(new_tokens):
        sequence.append(int(logits(model, sequence)[-1].argmax()))
    return sequence[len(token_ids):]


def test_the_engine_serves_fp8_experts(checkpoint):
    """`LLM(quantization="fp8")` generates the greedy tokens of the FP8 model whose experts are
    dequantized (the same arithmetic on the CPU), through chunked, batched steps."""
    files, _ = checkpoint
    prompts = [prompt(3, 7), prompt(4, 19)]
    reference = with_experts_dequantized(load(checkpoint, "fp8"))
    expected = [greedy(reference, token_ids, 8) for token_ids in prompts]
    with LLM(str(files.path), device="cpu", dtype="float32", quantization="fp8", max_model_len=128) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                               SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert [list(out.outputs[0].token_ids) for out in outputs] == expected
