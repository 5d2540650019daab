"""Decoder families, chosen from a Hugging Face config: one model file per family, its layers,
its rotary scaling and the loaders of their weights (safetensors, GGUF, dummy; shards for
tensor parallelism).

May import: worker/attention and the floors below it, kernels/, protocol/, torch.
"""

from __future__ import annotations

import torch
from torch import nn

from spillway.worker.models.llama import LlamaForCausalLM
from spillway.worker.models.spec import model_type_of

_FAMILIES: dict[str, type[nn.Module]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
    "qwen3_moe": LlamaForCausalLM,
    "mixtral": LlamaForCausalLM,
    "deepseek_v2": LlamaForCausalLM,
    "deepseek_v3": LlamaForCausalLM,
}


def model_class_for(config) -> type[nn.Module]:
    """The class implementing `config`'s family (by `model_type`, else `architectures`)."""
    model_type = model_type_of(config)
    if model_type not in _FAMILIES:
        architectures = getattr(config, "architectures", None)
        raise ValueError(
            f"unsupported model: model_type {model_type!r}, architectures {architectures}; "
            f"supported model types: {', '.join(_FAMILIES)}"
        )
    return _FAMILIES[model_type]


def build_model(config, *, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """The model for `config` on `device` in `dtype`, its weights uninitialised."""
    return model_class_for(config).build(config, device=device, dtype=dtype)
