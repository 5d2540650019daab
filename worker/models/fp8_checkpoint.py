"""FP8 checkpoints: which ones run, and their projections' weights dequantized as they stream in.

    config.json quantization_config                       per projection `P`
    quant_method "fp8", weight_block_size [128, 128],     P.weight fp8 [out, in], P.weight_scale_inv
      activation_scheme "dynamic" (DeepSeek V3,             [ceil(out/128), ceil(in/128)]: the weight
      Qwen3-*-FP8)                                          is `w * scale_inv` per 128 x 128 tile
    quant_method "fp8" without a block size               P.weight fp8, P.weight_scale [] or [1]
    quant_method "compressed-tensors", float weights of    P.weight fp8, P.weight_scale [1] (strategy
      8 bits, dynamic (or no) input activations             "tensor"), [out, 1] ("channel"), or per
                                                            tile ("block", its block_structure)

Calibrated scales are read, checked and left unused: a static checkpoint's `P.input_scale`
(`activation_scheme "static"`, compressed-tensors' `dynamic: false`), because activations are
quantized per token as they arrive, which needs no calibration and is at least as exact (a
token's own amax, never clipped by a scale calibrated on other text); and the attention's
`k_scale` / `v_scale` (compressed-tensors' `kv_cache_scheme`), because the fp8 KV cache
(`--kv-cache-dtype fp8`) stores keys and values unscaled, as for every model. One log line says
how many were left unused.

How block-scaled weights run: dequantized here (float32, exact: an fp8 value times its tile's
scale), then re-quantized with one scale per output row like any `--quantization fp8` model
(fp8_linear.py), so every FP8 model runs the one row-scaled product, `torch._scaled_mm` on a
GPU (cuBLASLt's FP8 GEMM, which takes no 128 x 128 tile scales), and tensor parallelism cuts
plain rows whatever the tiles. The cost is a second rounding: each weight moves by at most half
an fp8 step (relative 2^-4), and a value below `2^-6 * row scale` (the row's amax / 448: a
tile scaled far below the row's largest) falls among fp8's subnormals, exact to
`2^-10 * row scale` only. `tests/worker/models/test_fp8_checkpoints.py`
holds the loaded weights to that bound. A mixture-of-experts layer's experts go the same way:
each expert's projections dequantized here, stacked as the model loads them, then re-quantized
per output row of each expert (fp8_experts.py), which the fused MoE kernel runs weight-only
(kernels/fused_moe.py); one line of the log counts them. Until they are re-quantized they take
the model's dtype, twice their fp8 bytes, as the projections do.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from spillway.worker.models.fp8_linear import FP8_DTYPE

logger = logging.getLogger(__name__)

BLOCK_SCALE = "weight_scale_inv"
PLAIN_SCALE = "weight_scale"
# Scales calibrated for static activations and for an fp8 KV cache: read and checked, not used.
CALIBRATED_SCALES = ("input_scale", "k_scale", "v_scale", "kv_scale")
QUANT_METHODS = ("fp8", "compressed-tensors")


@dataclass(frozen=True, slots=True)
class Fp8Checkpoint:
    """How a checkpoint stores its FP8 projections: the scale tensor's suffix, and the tile
    `(rows, columns)` one scale covers (None: one scale per tensor or per output row)."""

    scale_suffix: str
    block: tuple[int, int] | None = None


def fp8_checkpoint_of(hf_config) -> Fp8Checkpoint | None:
    """The FP8 format `hf_config`'s `quantization_config` declares; None where it declares none.
    ValueError for another method or weights that are not fp8."""
    quantization = getattr(hf_config, "quantization_config", None)
    if quantization is None:
        return None
    if not isinstance(quantization, dict):
        quantization = quantization.to_dict()
    method = quantization.get("quant_method")
    if method == "fp8":
        return _fp8_method(quantization)
    if method == "compressed-tensors":
        return _compressed_tensors(quantization)
    raise ValueError(f"the checkpoint's quantization_config has quant_method {method!r}; Spillway runs "
                     f"{' and '.join(repr(m) for m in QUANT_METHODS)} FP8 checkpoints only")


def _fp8_method(quantization: dict) -> Fp8Checkpoint:
    scheme = quantization.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise ValueError(f"the checkpoint's activation_scheme is {scheme!r}; expected 'dynamic' or 'static'")
    block = quantization.get("weight_block_size")
    if block is None:
        return Fp8Checkpoint(PLAIN_SCALE)
    return Fp8Checkpoint(BLOCK_SCALE, _block_shape(block, "weight_block_size"))


def _compressed_tensors(quantization: dict) -> Fp8Checkpoint:
    blocks = set()
    for group_name, group in quantization.get("config_groups", {}).items():
        weights = group.get("weights") or {}
        if weights.get("num_bits") != 8 or weights.get("type") != "float":
            raise ValueError(f"compressed-tensors group {group_name!r} has {weights.get('num_bits')}-bit "
                             f"{weights.get('type')} weights; Spillway runs 8-bit float (FP8) weights only")
        if weights.get("strategy") == "block":
            blocks.add(_block_shape(weights.get("block_structure"), f"group {group_name!r}'s block_structure"))
    if len(blocks) > 1:
        raise ValueError(f"compressed-tensors groups with different block structures {sorted(blocks)}")
    return Fp8Checkpoint(PLAIN_SCALE, blocks.pop() if blocks else None)


def _block_shape(block, what: str) -> tuple[int, int]:
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ValueError(f"the checkpoint's {what} must be two positive integers, got {block!r}")
    return block[0], block[1]


def dequantized_weights(weights: Iterable[tuple[str, torch.Tensor]], checkpoint: Fp8Checkpoint | None
                        ) -> Iterator[tuple[str, torch.Tensor]]:
    """`weights` with every fp8 projection weight replaced by its float32 dequantization and its
    scale tensor consumed; any other tensor as it comes. A weight and its scale may come in
    either order. ValueError naming the tensor for an fp8 weight where none is expected (no
    `checkpoint`, or not a projection's), a missing scale, a scale without its weight, or a scale
    of the wrong shape. A calibrated scale (CALIBRATED_SCALES: the module's docstring) is
    checked (ValueError unless positive and finite) and consumed."""
    waiting_weights: dict[str, torch.Tensor] = {}
    waiting_scales: dict[str, torch.Tensor] = {}
    experts = calibrated = 0
    for name, tensor in weights:
        if checkpoint is not None and name.rpartition(".")[2] in CALIBRATED_SCALES:
            _check_calibrated_scale(name, tensor)
            calibrated += 1
            continue
        if tensor.dtype == FP8_DTYPE:
            _check_fp8_expected(name, checkpoint)
            prefix = name.removesuffix(".weight")
            if prefix not in waiting_scales:
                waiting_weights[prefix] = tensor
                continue
            scale = waiting_scales.pop(prefix)
        elif checkpoint is not None and name.endswith(f".{checkpoint.scale_suffix}"):
            prefix = name.removesuffix(f".{checkpoint.scale_suffix}")
            if prefix not in waiting_weights:
                waiting_scales[prefix] = tensor
                continue
            tensor, scale = waiting_weights.pop(prefix), tensor
        else:
            yield name, tensor
            continue
        experts += ".experts." in prefix
        yield f"{prefix}.weight", dequantize_weight(prefix, tensor, scale, checkpoint)
    _check_all_paired(waiting_weights, waiting_scales, checkpoint)
    if calibrated:
        logger.info("FP8 checkpoint: %d calibrated scales left unused: activations are quantized per token as they "
                    "arrive, and an fp8 KV cache stores keys and values unscaled", calibrated)
    if experts:
        logger.info("FP8 checkpoint: %d expert weights dequantized as they load, to run re-quantized per output "
                    "row", experts)


def _check_calibrated_scale(name: str, scale: torch.Tensor) -> None:
    if scale.numel() == 0 or not bool(torch.isfinite(scale.float()).all() and (scale.float() > 0).all()):
        raise ValueError(f"checkpoint tensor {name} must hold positive, finite scales, got {scale.flatten()[:4].tolist()}")


def _check_fp8_expected(name: str, checkpoint: Fp8Checkpoint | None) -> None:
    if checkpoint is None:
        raise ValueError(f"checkpoint tensor {name} is float8_e4m3fn, but config.json declares no FP8 "
                         f"quantization_config")
    if not is_projection_weight(name):
        raise ValueError(f"checkpoint tensor {name} is float8_e4m3fn; only the decoder's projection weights "
                         f"may be (embeddings, norms, routers and the lm_head stay unquantized)")


def is_projection_weight(name: str) -> bool:
    """A linear projection's weight: `..._proj.weight` (`kv_a_proj_with_mqa` included) or an
    expert's `w1`/`w2`/`w3` (Mixtral's names), of a decoder layer."""
    parts = name.split(".")
    return (len(parts) >= 2 and parts[-1] == "weight" and ".layers." in f".{name}"
            and ("_proj" in parts[-2] or parts[-2] in ("w1", "w2", "w3")))


def _check_all_paired(waiting_weights: dict[str, torch.Tensor], waiting_scales: dict[str, torch.Tensor],
                      checkpoint: Fp8Checkpoint | None) -> None:
    if waiting_weights:
        suffix = checkpoint.scale_suffix if checkpoint is not None else PLAIN_SCALE
        missing = sorted(f"{prefix}.{suffix}" for prefix in waiting_weights)
        raise ValueError(f"FP8 checkpoint is missing the scale tensor of each fp8 weight: {missing}")
    if waiting_scales:
        orphans = sorted(f"{prefix}.{checkpoint.scale_suffix}" for prefix in waiting_scales)
        raise ValueError(f"FP8 checkpoint has scale tensors without an fp8 weight (a missing or unquantized "
                         f"weight): {orphans}")


def dequantize_weight(prefix: str, weight: torch.Tensor, scale: torch.Tensor, checkpoint: Fp8Checkpoint
                      ) -> torch.Tensor:
    """`prefix.weight` (fp8 `[out, in]`) times its scale, in float32; ValueError naming the scale
    tensor when its shape fits neither the checkpoint's tiles nor a tensor or row scale."""
    rows, columns = weight.shape[-2:]
    scale_name = f"{prefix}.{checkpoint.scale_suffix}"
    if checkpoint.block is not None:
        block_rows, block_columns = checkpoint.block
        expected = (*weight.shape[:-2], math.ceil(rows / block_rows), math.ceil(columns / block_columns))
        if tuple(scale.shape) != expected:
            raise ValueError(f"{scale_name} has shape {tuple(scale.shape)}, expected {expected}: one scale per "
                             f"{block_rows} x {block_columns} tile of {prefix}.weight {tuple(weight.shape)}")
        tiles = scale.float().repeat_interleave(block_rows, -2)[..., :rows, :]
        return weight.float() * tiles.repeat_interleave(block_columns, -1)[..., :columns]
    if scale.numel() == 1:
        return weight.float() * scale.float().reshape(())
    if tuple(scale.shape) in ((rows, 1), (rows,)):
        return weight.float() * scale.float().reshape(rows, 1)
    raise ValueError(f"{scale_name} has shape {tuple(scale.shape)}, expected [1] (one scale for the tensor) or "
                     f"[{rows}, 1] (one per output row) for {prefix}.weight {tuple(weight.shape)}")
