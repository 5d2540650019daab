"""Rotary scaling (worker/models/rope_scaling.py) against transformers' rope init functions:
the inverse frequencies bit for bit and the attention factor exactly, read from the same
config; the factor carried by both the plain-torch cos/sin and the kernels' tables."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from spillway.worker.models.layers import RotaryEmbedding, rotary_inv_freq
from spillway.worker.models.rope_scaling import Llama3RopeScaling, YarnRopeScaling
from spillway.worker.models.spec import rope_from_config

# id: (head_dim, rope_theta, max_position_embeddings, rope_parameters, other config values)
CASES = {
    "qwen-factor-4": (128, 1e6, 40960, dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32768), {}),
    "deepseek-v2-equal-mscales": (64, 10000.0, 163840, dict(
        rope_type="yarn", factor=40.0, original_max_position_embeddings=4096, beta_fast=32, beta_slow=1,
        mscale=0.707, mscale_all_dim=0.707), {}),
    "unequal-mscales": (64, 10000.0, 163840, dict(
        rope_type="yarn", factor=40.0, original_max_position_embeddings=4096, mscale=1.0, mscale_all_dim=0.707), {}),
    "mscale-alone-ignored": (64, 10000.0, 8192, dict(
        rope_type="yarn", factor=2.0, original_max_position_embeddings=4096, mscale=0.707), {}),
    "gpt-oss-untruncated": (64, 150000.0, 131072, dict(
        rope_type="yarn", factor=32.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0,
        truncate=False), {}),
    "explicit-attention-factor": (128, 1e6, 65536, dict(
        rope_type="yarn", factor=8.0, original_max_position_embeddings=8192, attention_factor=1.5), {}),
    "other-betas": (128, 500000.0, 16384, dict(
        rope_type="yarn", factor=2.0, original_max_position_embeddings=8192, beta_fast=16, beta_slow=2), {}),
    "factor-from-context-lengths": (128, 1e6, 131072, dict(
        rope_type="yarn", factor=None, original_max_position_embeddings=32768), {}),
    "ramp-ends-clamped-together": (16, 10000.0, 8, dict(
        rope_type="yarn", factor=2.0, original_max_position_embeddings=4), {}),
    "original-from-config-attribute": (16, 10000.0, 256, dict(
        rope_type="yarn", factor=16.0, original_max_position_embeddings=8), dict(original_max_position_embeddings=16)),
    "tiny-factor-16": (16, 10000.0, 256, dict(rope_type="yarn", factor=16.0, original_max_position_embeddings=16), {}),
    "llama3": (128, 500000.0, 131072, dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=8192), {}),
}


def hf_config(case: str) -> transformers.Qwen3Config:
    head_dim, theta, max_positions, params, extra = CASES[case]
    return transformers.Qwen3Config(head_dim=head_dim, max_position_embeddings=max_positions,
                                    rope_parameters=dict(rope_theta=theta, **params), **extra)


@pytest.mark.parametrize("case", CASES)
def test_frequencies_and_attention_factor_equal_transformers(case):
    config = hf_config(case)
    theta, scaling = rope_from_config(config)
    expected_inv_freq, expected_factor = ROPE_INIT_FUNCTIONS[config.rope_parameters["rope_type"]](config)

    assert torch.equal(rotary_inv_freq(config.head_dim, theta, scaling), expected_inv_freq)
    assert scaling.attention_factor == expected_factor


def test_yarn_reads_transformers_defaults_and_either_config_style():
    qwen = dict(factor=4.0, original_max_position_embeddings=32768)
    expected = (1e6, YarnRopeScaling(factor=4.0, original_max_position_embeddings=32768,
                                     attention_factor=0.1 * math.log(4.0) + 1.0, beta_fast=32.0, beta_slow=1.0,
                                     truncate=True))
    new_style = SimpleNamespace(rope_parameters=dict(rope_type="yarn", rope_theta=1e6, **qwen))
    old_style = SimpleNamespace(rope_theta=1e6, max_position_embeddings=40960, rope_scaling=dict(type="yarn", **qwen))
    assert rope_from_config(new_style) == expected
    assert rope_from_config(old_style) == expected
    # DeepSeek's equal mscales leave cos and sin unscaled (its softmax takes the correction).
    deepseek = dict(rope_type="yarn", factor=40, original_max_position_embeddings=4096, mscale=1.0, mscale_all_dim=1.0)
    assert rope_from_config(SimpleNamespace(rope_parameters=deepseek))[1].attention_factor == 1.0


def test_original_context_falls_back_to_max_position_embeddings():
    config = SimpleNamespace(max_position_embeddings=8192, rope_parameters=dict(
        rope_type="llama3", rope_theta=5e5, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0))
    assert rope_from_config(config) == (5e5, Llama3RopeScaling(8.0, 1.0, 4.0, 8192))


def test_refusals_name_what_is_supported():
    with pytest.raises(ValueError, match="'longrope'; supported: default, llama3, yarn"):
        rope_from_config(SimpleNamespace(rope_parameters=dict(rope_type="longrope", rope_theta=1e4)))
    partial = SimpleNamespace(rope_parameters=dict(rope_type="yarn", rope_theta=1e4, factor=4.0,
                                                   original_max_position_embeddings=4096, partial_rotary_factor=0.5))
    with pytest.raises(ValueError, match="partial_rotary_factor=0.5 is not supported"):
        rope_from_config(partial)
    no_lengths = SimpleNamespace(rope_parameters=dict(rope_type="yarn", rope_theta=1e4, factor=4.0))
    with pytest.raises(ValueError, match="needs original_max_position_embeddings"):
        rope_from_config(no_lengths)


def test_kernel_tables_and_cos_sin_carry_the_attention_factor_as_transformers():
    config = hf_config("tiny-factor-16")  # trained on 16 positions
    theta, scaling = rope_from_config(config)
    rotary = RotaryEmbedding(config.head_dim, theta, scaling)
    assert rotary.attention_factor == pytest.approx(0.1 * math.log(16.0) + 1.0)
    positions = torch.arange(64)

    rotary.reserve_positions(64)
    cos, sin = rotary.cos_sin(positions, torch.float32)

    assert torch.equal(rotary.cos_cache, cos) and torch.equal(rotary.sin_cache, sin)
    hf_cos, hf_sin = transformers.models.qwen3.modeling_qwen3.Qwen3RotaryEmbedding(config)(
        torch.zeros(1, dtype=torch.float32), positions[None])
    half = config.head_dim // 2
    assert torch.equal(cos, hf_cos[0, :, :half]) and torch.equal(sin, hf_sin[0, :, :half])
