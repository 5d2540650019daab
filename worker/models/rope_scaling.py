"""How a checkpoint stretches its rotary wavelengths past the context it was trained on.

A scaling is a frozen dataclass, read from the config by `spec.rope_from_config`, that gives
what transformers' rope init functions (`transformers.modeling_rope_utils`) return:
`inv_freq(head_dim, theta)`, the inverse frequencies, and `attention_factor`, which cos and
sin are multiplied by (so q.k by its square). No scaling (None) is `default_inv_freq` with
a factor of 1.

    rope_type  inv_freq                                       attention_factor
    llama3     long wavelengths / factor, short kept,         1
               the band between interpolated
    yarn       per dimension, a ramp from extrapolated        0.1 ln(factor) + 1, or DeepSeek's
               (fast) to interpolated (slow, / factor)        mscale ratio, or as given

The arithmetic is transformers', operation for operation, in float32 on the CPU (a model is
built on the meta device), so the frequencies equal its bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch


def _exponents(head_dim: int) -> torch.Tensor:
    return torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim


def default_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    """Unscaled inverse frequencies `theta ** (-2i / head_dim)`, `[head_dim // 2]` float32."""
    return 1.0 / (theta ** _exponents(head_dim))


@dataclass(frozen=True, slots=True)
class Llama3RopeScaling:
    """Llama 3.1's frequency-dependent stretch of the rotary wavelengths."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int
    attention_factor: ClassVar[float] = 1.0

    def inv_freq(self, head_dim: int, theta: float) -> torch.Tensor:
        inv_freq = default_inv_freq(head_dim, theta)
        # Long wavelengths are divided by `factor`, short ones kept, the band between interpolated.
        old_len = self.original_max_position_embeddings
        low_freq_wavelen = old_len / self.low_freq_factor
        high_freq_wavelen = old_len / self.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / self.factor, inv_freq)
        smooth = (old_len / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction `0.1 * mscale * ln(factor) + 1` (1 for factor <= 1).

    Also what DeepSeek's attention multiplies its softmax scale by, squared, with
    `mscale_all_dim` (transformers' `yarn_apply_mscale`); that belongs to its attention."""
    if factor <= 1:
        return 1.0
    return 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True, slots=True)
class YarnRopeScaling:
    """YaRN (arXiv 2309.00071): each rotary dimension between extrapolation (its wavelength
    fits `original_max_position_embeddings` more than `beta_fast` times: kept) and
    interpolation (fewer than `beta_slow` times: divided by `factor`), a linear ramp between
    the two by dimension index; cos and sin are multiplied by `attention_factor`.

    `truncate` rounds the ramp's ends out to whole dimensions (transformers' default; gpt-oss
    turns it off). `attention_factor` is resolved when the config is read (`from_params`).
    """

    factor: float
    original_max_position_embeddings: int
    attention_factor: float
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True

    @classmethod
    def from_params(cls, params: Mapping, original_max_position_embeddings: int,
                    max_position_embeddings: int | None) -> YarnRopeScaling:
        """From a `rope_parameters` / `rope_scaling` dict, as transformers reads it.

        `factor` absent or null is `max_position_embeddings / original_max_position_embeddings`,
        the ratio of the two contexts. Without an `attention_factor`, it is `yarn_mscale(factor)`, or
        `yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)` when both are given
        (DeepSeek's: 1 when they are equal, the whole correction then going to its softmax).
        A beta that is absent or 0 takes its default, as in transformers.
        """
        factor = params.get("factor")
        if factor is None:
            if not max_position_embeddings:
                raise ValueError("yarn rope scaling without a factor needs max_position_embeddings to derive it")
            factor = max_position_embeddings / original_max_position_embeddings
        attention_factor = params.get("attention_factor")
        if attention_factor is None:
            mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
            if mscale and mscale_all_dim:
                attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
            else:
                attention_factor = yarn_mscale(factor)
        return cls(
            factor=float(factor),
            original_max_position_embeddings=int(original_max_position_embeddings),
            attention_factor=float(attention_factor),
            beta_fast=float(params.get("beta_fast") or 32),
            beta_slow=float(params.get("beta_slow") or 1),
            truncate=bool(params.get("truncate", True)),
        )

    def inv_freq(self, head_dim: int, theta: float) -> torch.Tensor:
        pos_freqs = theta ** _exponents(head_dim)
        extrapolated = 1.0 / pos_freqs
        interpolated = 1.0 / (self.factor * pos_freqs)
        low, high = self._ramp_ends(head_dim, theta)
        if low == high:
            high += 0.001  # a step, not a division by zero
        ramp = (torch.arange(head_dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)
        extrapolated_share = 1 - ramp.clamp(0, 1)
        return interpolated * (1 - extrapolated_share) + extrapolated * extrapolated_share

    def _ramp_ends(self, head_dim: int, theta: float) -> tuple[float, float]:
        """The dimension indices where the ramp leaves extrapolation (`beta_fast` rotations
        within the original context) and reaches interpolation (`beta_slow`)."""

        def dim_of(num_rotations: float) -> float:
            # Dimension d's wavelength is 2 pi theta^(2d / head_dim); solved for d.
            theta_power = self.original_max_position_embeddings / (num_rotations * 2 * math.pi)
            return (head_dim * math.log(theta_power)) / (2 * math.log(theta))

        low, high = dim_of(self.beta_fast), dim_of(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        return max(low, 0), min(high, head_dim - 1)


# What every scaling gives: `inv_freq(head_dim, theta)` and `attention_factor`.
RopeScaling = Llama3RopeScaling | YarnRopeScaling
ROPE_TYPES = ("default", "llama3", "yarn")
