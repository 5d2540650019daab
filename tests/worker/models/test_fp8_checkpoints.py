"""FP8 checkpoints, written here from small random models: block-scaled (DeepSeek V3 / Qwen3-*-FP8:
`weight_scale_inv` per 128 x 128 tile) and compressed-tensors (`weight_scale` per tensor or per
output row). They load as their dequantization re-quantized per output row, run as the
dequantized model quantized online does (bit for bit), close to the unquantized dequantized
model, on one rank or cut over two; a mixture of experts' experts the same way, fp8 too;
malformed ones are refused naming the tensor."""

from __future__ import annotations

import json
import logging
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from spillway.gateway import LLM, SamplingParams
from spillway.worker.models import build_model, loader
from spillway.worker.models.fp8_checkpoint import dequantize_weight, Fp8Checkpoint, is_projection_weight
from spillway.worker.models.fp8_experts import Fp8Experts, quantize_experts
from spillway.worker.models.fp8_linear import FP8_DTYPE, FP8_MAX, Fp8Linear, quantize_linear_layers
from spillway.worker.models.tensor_parallel import shard_model
from spillway.worker.runner.executor import load_model
from spillway.tools.bench.engine.fp8_accuracy import compare_logits, teacher_forced_logits

CPU = torch.device("cpu")
TILE = 128
BLOCK_CONFIG = {"quant_method": "fp8", "weight_block_size": [TILE, TILE], "activation_scheme": "dynamic",
                "fmt": "e4m3"}


def compressed_tensors_config(strategy: str, dynamic_inputs: bool = True) -> dict:
    inputs = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": dynamic_inputs, "symmetric": True}
    weights = {"num_bits": 8, "type": "float", "strategy": strategy, "dynamic": False, "symmetric": True}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": inputs}}}


FORMATS = {"block": BLOCK_CONFIG, "channel": compressed_tensors_config("channel"),
           "tensor": compressed_tensors_config("tensor")}


def quantize_for_checkpoint(weight: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(fp8 weight, scale tensor, dequantized float32 weight)` as a checkpoint of `layout` holds them."""
    rows, columns = weight.shape
    if layout == "block":
        padded = torch.zeros(math.ceil(rows / TILE) * TILE, math.ceil(columns / TILE) * TILE)
        padded[:rows, :columns] = weight.abs()
        tiles = padded.view(padded.shape[0] // TILE, TILE, padded.shape[1] // TILE, TILE).amax(dim=(1, 3))
        scale = tiles.clamp(min=1e-12) / FP8_MAX
        full = scale.repeat_interleave(TILE, 0)[:rows].repeat_interleave(TILE, 1)[:, :columns]
    elif layout == "channel":
        scale = weight.abs().amax(-1, keepdim=True) / FP8_MAX
        full = scale
    else:
        scale = (weight.abs().max() / FP8_MAX).reshape(1)
        full = scale
    quantized = (weight / full).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return quantized, scale, quantized.float() * full


def save_fp8_checkpoint(hf_model, path: Path, layout: str) -> dict[str, torch.Tensor]:
    """`hf_model` saved in `path` with every decoder projection in fp8 (`layout`: FORMATS' keys);
    returns the dequantized state dict (the checkpoint's values, as a plain model would hold them)."""
    plain = path.parent / f"{path.name}-plain"
    hf_model.save_pretrained(plain)
    tensors, dequantized = {}, {}
    for weights_file in loader.safetensors_files(plain):
        with safe_open(weights_file, framework="pt") as f:
            for name in f.keys():
                tensor = f.get_tensor(name)
                dequantized[name] = tensor
                if not is_projection_weight(name):
                    tensors[name] = tensor
                    continue
                quantized, scale, dequantized[name] = quantize_for_checkpoint(tensor.float(), layout)
                suffix = "weight_scale_inv" if layout == "block" else "weight_scale"
                tensors[name], tensors[name.removesuffix("weight") + suffix] = quantized, scale
    path.mkdir()
    config = json.loads((plain / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "quantization_config": FORMATS[layout]}))
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    shutil.rmtree(plain)
    return dequantized


def tiny_qwen3(seed: int = 0):
    """Dimensions past one 128 tile and not multiples of it; some input columns 50x smaller than
    the rest, so that a row's tiles have different scales."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=384, hidden_size=160, intermediate_size=272, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=48, max_position_embeddings=512,
                         tie_word_embeddings=False, eos_token_id=1)
    model = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.8, 1.2)
            else:
                param.normal_(0, 0.2)
                if param.dim() == 2 and param.shape[1] > TILE:
                    param[:, TILE:] *= 0.02
    return model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{layout: (folder, dequantized state dict)}, the same random model in each layout."""
    root = tmp_path_factory.mktemp("fp8")
    return {layout: (root / layout, save_fp8_checkpoint(tiny_qwen3(), root / layout, layout)) for layout in FORMATS}


def resolve(folder: Path):
    files = loader.resolve_model(str(folder))
    return files, loader.load_config(files)


def dequantized_model(hf_config, dequantized: dict[str, torch.Tensor]):
    """The plain float32 model holding the checkpoint's dequantized weights."""
    model = build_model(hf_config, device=CPU, dtype=torch.float32)
    model.load_weights(dequantized.items())
    return model


def fp8_modules(model) -> dict[str, Fp8Linear]:
    return {name: module for name, module in model.named_modules() if isinstance(module, Fp8Linear)}


@pytest.mark.parametrize("layout", list(FORMATS))
def test_fp8_weights_load_as_their_dequantization_quantized_per_row(checkpoints, layout):
    """Per output row, the loaded weight is the checkpoint's dequantized weight within half an fp8
    step (2^-4 relative, 2^-10 of the row's scale for subnormals); per-row checkpoints load their
    own fp8 values bit for bit."""
    folder, dequantized = checkpoints[layout]
    files, hf_config = resolve(folder)
    model = load_model(hf_config, files, device=CPU, dtype=torch.float32, seed=0)
    loaded = fp8_modules(model)
    assert len(loaded) == 8  # qkv, o, gate_up, down in each of 2 layers
    qkv = loaded["model.layers.1.self_attn.qkv_proj"]
    expected = torch.cat([dequantized[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"])
    bound = 2.0 ** -4 * expected.abs() + 2.0 ** -10 * qkv.weight_scale[:, None]
    assert ((qkv.dequantized_weight() - expected).abs() <= bound).all()
    down = loaded["model.layers.0.mlp.down_proj"]
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        stored = f.get_tensor("model.layers.0.mlp.down_proj.weight")
    assert stored.dtype == FP8_DTYPE
    if layout == "channel":
        assert torch.equal(down.weight.view(torch.uint8), stored.view(torch.uint8))
    else:  # re-quantized: the row's own scale differs from the tile's or tensor's
        assert not torch.equal(down.weight.view(torch.uint8), stored.view(torch.uint8))


@pytest.mark.parametrize("layout", list(FORMATS))
def test_an_fp8_checkpoint_runs_as_its_dequantized_model_quantized_online(checkpoints, layout):
    folder, dequantized = checkpoints[layout]
    files, hf_config = resolve(folder)
    token_ids = torch.randint(2, 384, (90,), generator=torch.Generator().manual_seed(3)).tolist()
    fp8 = teacher_forced_logits(load_model(hf_config, files, device=CPU, dtype=torch.float32, seed=0), token_ids,
                                device=CPU, dtype=torch.float32)
    plain = dequantized_model(hf_config, dequantized)
    exact = teacher_forced_logits(plain, token_ids, device=CPU, dtype=torch.float32)
    quantize_linear_layers(plain)
    online = teacher_forced_logits(plain, token_ids, device=CPU, dtype=torch.float32)

    assert torch.equal(fp8, online)
    # Against the unquantized model, the per-token activations (and the per-row re-quantization)
    # round: measured 0.10-0.15 relative error of the logits and mean KL 0.02-0.05 nats over the
    # three layouts (this random model's distributions are flat, near-ties everywhere, so its
    # argmax is no measure). Bounds at twice that; a scale lost or misapplied is off by ~1.
    assert (fp8 - exact).norm() / exact.norm() < 0.3
    assert compare_logits(exact, fp8).mean_kl < 0.1


def test_an_fp8_checkpoint_serves_greedy_tokens_of_its_online_quantized_dequantization(checkpoints, tmp_path):
    folder, dequantized = checkpoints["block"]
    plain = tmp_path / "dequantized"
    plain.mkdir()
    config = json.loads((folder / "config.json").read_text())
    del config["quantization_config"]
    (plain / "config.json").write_text(json.dumps(config))
    save_file({name: tensor.contiguous() for name, tensor in dequantized.items()}, str(plain / "model.safetensors"))
    prompts = [[5, 9, 200, 31], [7] * 20]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outputs = {}
    for name, model, quantization in (("checkpoint", folder, None), ("online", plain, "fp8")):
        with LLM(str(model), device="cpu", dtype="float32", quantization=quantization) as llm:
            outputs[name] = [out.outputs[0].token_ids for out in llm.generate(prompts, greedy, use_tqdm=False)]
    assert outputs["checkpoint"] == outputs["online"]
    assert all(len(tokens) == 8 for tokens in outputs["checkpoint"])


@pytest.mark.parametrize("layout", ["block", "tensor"])
def test_each_rank_loads_its_rows_of_the_dequantized_checkpoint_and_quantizes_them(checkpoints, layout):
    """The tiles' scales span both ranks' rows: read whole, dequantized, then cut, the same as
    cutting the whole dequantized model; quantized after the cut."""
    folder, dequantized = checkpoints[layout]
    files, hf_config = resolve(folder)
    for rank in range(2):
        shard = load_model(hf_config, files, device=CPU, dtype=torch.float32, seed=0, shard=(rank, 2))
        expected = dequantized_model(hf_config, dequantized)
        shard_model(expected, rank, 2)
        quantize_linear_layers(expected)
        got, want = fp8_modules(shard), fp8_modules(expected)
        assert got.keys() == want.keys() and len(got) == 8
        for name, module in got.items():
            assert module.weight.shape == want[name].weight.shape, name
            assert torch.equal(module.weight.view(torch.uint8), want[name].weight.view(torch.uint8)), name
            assert torch.equal(module.weight_scale, want[name].weight_scale), name


def test_block_scales_cover_partial_tiles_at_the_edges():
    weight = torch.randn(200, 300).to(FP8_DTYPE)
    scale = torch.rand(2, 3) + 0.5
    got = dequantize_weight("w", weight, scale, Fp8Checkpoint("weight_scale_inv", (TILE, TILE)))
    for row in (0, 127, 128, 199):
        for column in (0, 127, 128, 255, 256, 299):
            assert got[row, column] == weight[row, column].float() * scale[row // TILE, column // TILE]


@pytest.fixture(scope="module")
def moe_checkpoints(tmp_path_factory):
    """{layout: (folder, dequantized state dict)} of one tiny Qwen3-MoE (2 sparse layers of 6
    experts, a dense layer) in the block and channel layouts."""
    from tiny_models import tiny_qwen3_moe

    root = tmp_path_factory.mktemp("fp8-moe")
    return {layout: (root / layout, save_fp8_checkpoint(tiny_qwen3_moe(), root / layout, layout))
            for layout in ("block", "channel")}


def fp8_experts(model) -> dict[str, Fp8Experts]:
    return {name: module for name, module in model.named_modules() if isinstance(module, Fp8Experts)}


@pytest.mark.parametrize("layout", ["block", "channel"])
def test_moe_experts_load_as_their_dequantization_quantized_per_row(moe_checkpoints, layout, caplog):
    """Each expert's rows within half an fp8 step of the checkpoint's dequantized weights (a
    per-row checkpoint's own fp8 values, bit for bit), and the model runs as the dequantized one
    quantized online does."""
    folder, dequantized = moe_checkpoints[layout]
    files, hf_config = resolve(folder)
    with caplog.at_level(logging.INFO, logger="spillway.worker.models.fp8_checkpoint"):
        model = load_model(hf_config, files, device=CPU, dtype=torch.float32, seed=0)
    assert any("36 expert weights dequantized as they load" in record.getMessage() for record in caplog.records)
    assert list(fp8_experts(model)) == ["model.layers.0.mlp.experts", "model.layers.2.mlp.experts"]
    experts = model.model.layers[2].mlp.experts
    assert experts.gate_up_proj.dtype == experts.down_proj.dtype == FP8_DTYPE
    gate_up, down = experts.dequantized()
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        stored = f.get_tensor("model.layers.2.mlp.experts.5.up_proj.weight")
    for expert in range(6):
        prefix = f"model.layers.2.mlp.experts.{expert}"
        expected = [torch.cat([dequantized[f"{prefix}.gate_proj.weight"], dequantized[f"{prefix}.up_proj.weight"]]),
                    dequantized[f"{prefix}.down_proj.weight"]]
        for got, want, scale in zip((gate_up[expert], down[expert]), expected,
                                    (experts.gate_up_proj_scale[expert], experts.down_proj_scale[expert])):
            assert ((got - want).abs() <= 2.0 ** -4 * want.abs() + 2.0 ** -10 * scale[:, None]).all(), expert
    up_rows = experts.gate_up_proj[5, 32:].view(torch.uint8)
    assert torch.equal(up_rows, stored.view(torch.uint8)) == (layout == "channel")

    plain = dequantized_model(hf_config, dequantized)
    assert quantize_linear_layers(plain) == 8 and quantize_experts(plain) == 2  # qkv, o x 3; the dense MLP
    token_ids = torch.randint(2, 384, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    assert torch.equal(teacher_forced_logits(model, token_ids, device=CPU, dtype=torch.float32),
                       teacher_forced_logits(plain, token_ids, device=CPU, dtype=torch.float32))


def test_each_rank_quantizes_its_rows_of_the_dequantized_experts(moe_checkpoints):
    """A rank's expert rows are those of the whole dequantized model cut, quantized after the cut:
    a down_proj row's scale is that of the rank's columns."""
    folder, dequantized = moe_checkpoints["block"]
    files, hf_config = resolve(folder)
    for rank in range(2):
        shard = fp8_experts(load_model(hf_config, files, device=CPU, dtype=torch.float32, seed=0, shard=(rank, 2)))
        expected = dequantized_model(hf_config, dequantized)
        shard_model(expected, rank, 2)
        quantize_experts(expected)
        want = fp8_experts(expected)
        assert shard.keys() == want.keys() and len(shard) == 2
        for name, experts in shard.items():
            assert experts.down_proj.shape == (6, 64, 16), name  # half of each expert's width of 32
            for tensor in ("gate_up_proj", "down_proj"):
                assert torch.equal(getattr(experts, tensor).view(torch.uint8),
                                   getattr(want[name], tensor).view(torch.uint8)), (name, tensor)
                assert torch.equal(getattr(experts, f"{tensor}_scale"), getattr(want[name], f"{tensor}_scale"))


def rewrite(folder: Path, tmp_path: Path, *, drop: str | None = None, replace: dict | None = None,
            quantization_config: dict | None | str = "keep") -> Path:
    """A copy of checkpoint `folder` with one tensor dropped or replaced, or another quantization_config."""
    copy = shutil.copytree(folder, tmp_path / "malformed")
    with safe_open(str(copy / "model.safetensors"), framework="pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys() if name != drop}
    save_file({**tensors, **(replace or {})}, str(copy / "model.safetensors"), metadata={"format": "pt"})
    if quantization_config != "keep":
        config = json.loads((copy / "config.json").read_text())
        config.pop("quantization_config")
        if quantization_config is not None:
            config["quantization_config"] = quantization_config
        (copy / "config.json").write_text(json.dumps(config))
    return copy


Q_PROJ = "model.layers.0.self_attn.q_proj"


@pytest.mark.parametrize("layout, change, message", [
    ("block", dict(drop=f"{Q_PROJ}.weight_scale_inv"),
     rf"missing the scale tensor of each fp8 weight: \['{Q_PROJ}.weight_scale_inv'\]"),
    ("block", dict(drop=f"{Q_PROJ}.weight"), rf"scale tensors without an fp8 weight .*\['{Q_PROJ}.weight_scale_inv'\]"),
    ("block", dict(replace={f"{Q_PROJ}.weight_scale_inv": torch.ones(1, 2)}),
     rf"{Q_PROJ}.weight_scale_inv has shape \(1, 2\), expected \(2, 2\): one scale per 128 x 128 tile"),
    ("channel", dict(replace={f"{Q_PROJ}.weight_scale": torch.ones(5, 1)}),
     rf"{Q_PROJ}.weight_scale has shape \(5, 1\), expected \[1\] .* or \[192, 1\]"),
    ("channel", dict(replace={"model.embed_tokens.weight": torch.zeros(384, 160).to(FP8_DTYPE)}),
     r"model.embed_tokens.weight is float8_e4m3fn; only the decoder's projection weights"),
    ("channel", dict(quantization_config=None),
     r"model.layers.0.[a-z_.]+.weight is float8_e4m3fn, but config.json declares no FP8"),
    ("block", dict(replace={f"{Q_PROJ}.input_scale": torch.tensor([0.0])}),
     rf"{Q_PROJ}.input_scale must hold positive, finite scales, got \[0.0\]"),
    ("channel", dict(replace={"model.layers.1.self_attn.k_scale": torch.tensor(float("nan"))}),
     r"model.layers.1.self_attn.k_scale must hold positive, finite scales, got \[nan\]"),
    ("block", dict(quantization_config={**BLOCK_CONFIG, "activation_scheme": "per-layer"}),
     r"activation_scheme is 'per-layer'; expected 'dynamic' or 'static'"),
    ("block", dict(quantization_config={"quant_method": "awq", "bits": 4}),
     r"quant_method 'awq'; Spillway runs 'fp8' and 'compressed-tensors' FP8 checkpoints only"),
])
def test_a_malformed_checkpoint_is_refused_naming_the_tensor(checkpoints, tmp_path, layout, change, message):
    folder = rewrite(checkpoints[layout][0], tmp_path, **change)
    files, hf_config = resolve(folder)
    with pytest.raises(ValueError, match=message):
        load_model(hf_config, files, device=CPU, dtype=torch.float32, seed=0)
    if "replace" in change or "drop" in change:  # the same refusal from a tensor-parallel rank's reading
        with pytest.raises(ValueError, match=message):
            load_model(hf_config, files, device=CPU, dtype=torch.float32, seed=0, shard=(1, 2))


@pytest.mark.parametrize("layout, static_config", [
    ("block", {**BLOCK_CONFIG, "activation_scheme": "static"}),
    ("channel", {**compressed_tensors_config("channel", dynamic_inputs=False),
                 "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}}),
])
def test_a_static_checkpoint_runs_as_its_dynamic_twin_its_calibrated_scales_left_unused(
        checkpoints, tmp_path, caplog, layout, static_config):
    """Calibrated input and KV-cache scales (vLLM serves such checkpoints) are checked and left
    unused: activations are quantized per token, so the logits equal the dynamic checkpoint's."""
    folder, _ = checkpoints[layout]
    calibrated = {f"model.layers.{layer}.{module}.input_scale": torch.tensor([0.05 + layer])
                  for layer in range(2) for module in ("self_attn.q_proj", "self_attn.o_proj", "mlp.down_proj")}
    calibrated.update({f"model.layers.{layer}.self_attn.{side}_scale": torch.tensor(1.5)
                       for layer in range(2) for side in "kv"})
    static = rewrite(folder, tmp_path, replace=calibrated, quantization_config=static_config)
    token_ids = list(range(2, 60))
    logits = {}
    for name, checkpoint in (("dynamic", folder), ("static", static)):
        files, hf_config = resolve(checkpoint)
        with caplog.at_level(logging.INFO, logger="spillway.worker.models.fp8_checkpoint"):
            model = load_model(hf_config, files, device=CPU, dtype=torch.float32, seed=0)
        logits[name] = teacher_forced_logits(model, token_ids, device=CPU, dtype=torch.float32)
    assert torch.equal(logits["static"], logits["dynamic"])
    assert [record.getMessage().split(":")[1] for record in caplog.records if "calibrated" in record.getMessage()] == [
        " 10 calibrated scales left unused"]
