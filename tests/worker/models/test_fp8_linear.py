"""FP8 projections (`--quantization fp8`): per-row weight scales, per-token activation scales,
the plain-torch product within fp8's rounding of the unquantized one, which projections a model
quantizes (after a tensor-parallel cut), and the `_scaled_mm` path against the reference on a GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers
from torch import nn

from spillway.worker.models.cpu_linear import PackedLinear, pack_linear_layers
from spillway.worker.models.fp8_linear import (
    FP8_DTYPE,
    FP8_MAX,
    Fp8Linear,
    dequantize_rows,
    fp8_linear_reference,
    fp8_linear_scaled_mm,
    quantize_linear_layers,
    quantize_rows,
)
from spillway.worker.models.gpu_linear import store_weights_input_major
from spillway.worker.models.layers import TORCH_OPS
from spillway.worker.models.llama import LlamaForCausalLM
from spillway.worker.models.tensor_parallel import shard_model

# e4m3 keeps 3 mantissa bits: rounding to nearest moves a normal value by at most 2^-4 of it; a
# subnormal one (below 2^-6 of the scale) by at most 2^-10 of the scale.
RELATIVE_STEP = 2.0 ** -4
SUBNORMAL_STEP = 2.0 ** -10


def _rounding_bound(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The most quantize_rows may move each value of `values` (rows scaled by `scale`)."""
    return RELATIVE_STEP * values.abs() + SUBNORMAL_STEP * scale[:, None]


def test_rows_are_scaled_by_their_amax_over_448_and_round_within_half_a_step():
    generator = torch.Generator().manual_seed(0)
    values = torch.randn(7, 300, generator=generator) * torch.logspace(-3, 3, 7)[:, None]
    values[3] = 0.0  # an all-zero row quantizes to zeros, not NaN
    quantized, scale = quantize_rows(values)

    assert quantized.dtype == FP8_DTYPE and scale.dtype == torch.float32 and scale.shape == (7,)
    nonzero = [0, 1, 2, 4, 5, 6]
    torch.testing.assert_close(scale[nonzero], values[nonzero].abs().amax(-1) / FP8_MAX)
    assert quantized[nonzero].float().abs().amax(-1).eq(FP8_MAX).all()  # each row's largest is fp8's largest
    restored = dequantize_rows(quantized, scale)
    assert torch.equal(restored[3], torch.zeros(300))
    assert ((restored - values).abs() <= _rounding_bound(values, scale)).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_reference_product_is_the_unquantized_one_within_fp8_rounding(dtype):
    """Bounded element by element: |dy| <= dx @ |w| + |x| @ dw + dx @ dw, with each operand's
    rounding bound, plus the output dtype's own rounding."""
    generator = torch.Generator().manual_seed(1)
    x = (torch.randn(9, 96, generator=generator) * 3).to(dtype)
    linear = nn.Linear(96, 48, dtype=dtype)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(48, 96, generator=generator) * 0.05)
        linear.bias.copy_(torch.randn(48, generator=generator))
    fp8 = Fp8Linear.from_linear(linear)
    assert fp8.weight.dtype == FP8_DTYPE and fp8.weight_scale.shape == (48,) and fp8.bias.dtype == dtype

    got = fp8(x)
    assert got.dtype == dtype and got.shape == (9, 48)
    x32, w32 = x.float(), linear.weight.float()
    exact = F.linear(x32, w32, linear.bias.float())
    dx = _rounding_bound(x32, x32.abs().amax(-1) / FP8_MAX)
    dw = _rounding_bound(w32, w32.abs().amax(-1) / FP8_MAX)
    bound = dx @ w32.abs().t() + x32.abs() @ dw.t() + dx @ dw.t()
    output_rounding = 1e-5 if dtype == torch.float32 else 2.0 ** -8
    assert ((got.float() - exact).abs() <= bound + output_rounding * exact.abs() + 1e-5).all()
    # The bound is not loose enough to hide a missing scale: unscaled, the product is far off.
    assert (fp8.weight.float() @ x32.t()).t().sub(exact).abs().max() > bound.max()


def test_the_reference_scales_the_fp8_product_by_both_row_scales():
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(4, 3, 32, generator=generator)
    weight, weight_scale = quantize_rows(torch.randn(16, 32, generator=generator))
    x_q, x_scale = quantize_rows(x.reshape(-1, 32))
    expected = dequantize_rows(x_q, x_scale) @ dequantize_rows(weight, weight_scale).t()

    got = fp8_linear_reference(x, weight, weight_scale, None)
    assert got.shape == (4, 3, 16)
    torch.testing.assert_close(got.reshape(-1, 16), expected, rtol=1e-6, atol=1e-6)


def _tiny_model(seed: int = 0) -> LlamaForCausalLM:
    config = transformers.Qwen3Config(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, tie_word_embeddings=False,
    )
    model = LlamaForCausalLM.build(config, device=torch.device("cpu"), dtype=torch.float32, ops=TORCH_OPS)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    return model


def test_every_decoder_projection_is_quantized_and_nothing_packs_or_relays_it_back():
    model = _tiny_model()
    whole = {name: tensor.clone() for name, tensor in model.checkpoint_weights()}

    assert quantize_linear_layers(model) == 8  # qkv, o, gate_up, down in each of 2 layers
    for layer in model.model.layers:
        projections = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
        assert all(type(module) is Fp8Linear for module in projections)
    assert type(model.lm_head) is nn.Linear and model.model.embed_tokens.weight.dtype == torch.float32
    qkv = model.model.layers[1].self_attn.qkv_proj
    q_rows = whole["model.layers.1.self_attn.q_proj.weight"]
    torch.testing.assert_close(qkv.weight_scale[:64], q_rows.abs().amax(-1) / FP8_MAX)

    assert store_weights_input_major(model) == 0  # the lm_head is no decoder projection
    assert qkv.weight.is_contiguous()  # [out, in] row-major: its transpose is _scaled_mm's column-major operand
    if pack_linear_layers(model):  # oneDNN packs the lm_head only, never an fp8 weight
        assert type(model.lm_head) is PackedLinear
        assert type(model.model.layers[0].mlp.down_proj) is Fp8Linear


def test_a_tensor_parallel_rank_quantizes_its_own_rows():
    """Quantized after the cut: a row-parallel projection's row scales come from the rank's
    columns only, not from the whole row."""
    whole = _tiny_model()
    o_whole = whole.model.layers[0].self_attn.o_proj.weight.detach().clone()
    down_whole = whole.model.layers[0].mlp.down_proj.weight.detach().clone()
    for rank in range(2):
        model = _tiny_model()
        shard_model(model, rank, 2)
        assert quantize_linear_layers(model) == 8
        o_proj = model.model.layers[0].self_attn.o_proj.linear
        down_proj = model.model.layers[0].mlp.down_proj.linear
        assert type(o_proj) is Fp8Linear and type(down_proj) is Fp8Linear
        columns = slice(rank * 32, (rank + 1) * 32)  # 2 of 4 heads of 16; 48 of 96 intermediate
        torch.testing.assert_close(o_proj.weight_scale, o_whole[:, columns].abs().amax(-1) / FP8_MAX)
        torch.testing.assert_close(down_proj.dequantized_weight(), down_whole[:, rank * 48:(rank + 1) * 48],
                                   rtol=RELATIVE_STEP, atol=1e-3)


@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_scaled_mm_matches_the_reference(rows, dtype, bias):
    device = torch.device("cuda")
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 256, generator=generator).to(device=device, dtype=dtype)
    linear = nn.Linear(256, 384, bias=bias, dtype=dtype, device=device)
    fp8 = Fp8Linear.from_linear(linear)
    assert fp8.product is fp8_linear_scaled_mm

    got = fp8(x)
    expected = fp8_linear_reference(x.cpu(), fp8.weight.cpu(), fp8.weight_scale.cpu(),
                                    None if fp8.bias is None else fp8.bias.cpu())
    assert got.dtype == dtype and got.shape == (rows, 384)
    # The same fp8 values and scales: only the accumulation order and the bfloat16 output differ.
    torch.testing.assert_close(got.float().cpu(), expected.float(), rtol=2.0 ** -7, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_small_models_fp8_logits_on_the_gpu_match_the_plain_torch_reference(tmp_path):
    """The same checkpoint quantized on the GPU (`_scaled_mm`, Triton kernels elsewhere) and on the
    CPU (the plain-torch reference): the fp8 path adds little to the difference the two devices'
    other kernels already make unquantized, measured in the same test."""
    from tiny_models import save_tiny_qwen3

    from spillway.tools.bench.engine.fp8_accuracy import compare_logits, teacher_forced_logits
    from spillway.worker.models import loader
    from spillway.worker.runner.executor import load_model

    files = loader.resolve_model(save_tiny_qwen3(tmp_path / "qwen3"))
    hf_config = loader.load_config(files)
    token_ids = torch.randint(2, 384, (100,), generator=torch.Generator().manual_seed(0)).tolist()
    logits = {}
    for device in (torch.device("cpu"), torch.device("cuda")):
        for quantization in (None, "fp8"):
            model = load_model(hf_config, files, device=device, dtype=torch.float32, seed=0, quantization=quantization)
            if quantization is not None and device.type == "cuda":
                assert all(module.product is fp8_linear_scaled_mm
                           for module in model.modules() if isinstance(module, Fp8Linear))
            logits[device.type, quantization] = teacher_forced_logits(model, token_ids, device=device,
                                                                      dtype=torch.float32)

    def relative(key):
        cpu, cuda = logits["cpu", key], logits["cuda", key]
        return float((cuda - cpu).norm() / cpu.norm())

    def kl(key):
        return compare_logits(logits["cpu", key], logits["cuda", key]).mean_kl

    # _scaled_mm writes bfloat16 (2^-9 relative per projection output) where the reference keeps
    # float32: the reference with its outputs rounded so gives 0.057 relative error of this model's
    # large logits and a mean KL of 0.001 nats on the CPU. Bounds: about 3x and 10x that, above
    # what the devices' other kernels differ by unquantized; a lost scale is off by ~1.
    assert relative("fp8") <= 0.15 + 2 * relative(None)
    assert kl("fp8") < 0.01 + 2 * kl(None)
