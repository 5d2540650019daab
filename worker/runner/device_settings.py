"""The worker's side of its configuration: device, dtype and KV cache dtype resolved on this
machine (torch). The configuration itself is a wire message (protocol/config.py)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from spillway.protocol.config import KV_CACHE_DTYPES, WorkerConfig

# A setting and its value as the caller wrote them (WorkerConfig.spell); this one for Python.
Spell = Callable[[str, object], str]
_ARGUMENT: Spell = lambda name, value: f"{name}={value!r}"  # noqa: E731

__all__ = ["KV_CACHE_DTYPES", "WorkerConfig", "resolve_device", "resolve_device_settings", "resolve_dtype",
           "resolve_kv_cache_dtype"]


def resolve_device(name: str, spell: Spell = _ARGUMENT) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{spell('device', name)} asked for, but no CUDA GPU is available")
    return device


def resolve_dtype(name: str, device: torch.device, spell: Spell = _ARGUMENT) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    table = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
             "float16": torch.float16, "half": torch.float16}
    if name not in table:
        raise ValueError(f"{spell('dtype', name)}: unknown dtype; choose one of auto, {', '.join(table)}")
    return table[name]


def resolve_kv_cache_dtype(name: str, dtype: torch.dtype, device: torch.device,
                           spell: Spell = _ARGUMENT) -> torch.dtype:
    """The KV cache's dtype: the model's `dtype` for "auto", float8 e4m3 (unscaled) for "fp8"
    and "fp8_e4m3". Only on CUDA: the CPU's plain-torch attention stays exact to Hugging Face.
    `spell` writes the setting in the messages as the caller wrote it."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"{spell('kv_cache_dtype', name)}: unknown kv_cache_dtype; choose one of "
                         f"{', '.join(KV_CACHE_DTYPES)}")
    if name == "auto":
        return dtype
    if device.type != "cuda":
        raise ValueError(f"{spell('kv_cache_dtype', name)}: an fp8 KV cache needs CUDA, and the device is {device}")
    capability = torch.cuda.get_device_capability(device)
    if capability < (8, 9):  # the kernels' e4m3 conversions are Ada / Hopper instructions
        raise ValueError(f"{spell('kv_cache_dtype', name)}: an fp8 KV cache needs a GPU of compute capability 8.9 "
                         f"or newer (Ada, Hopper), and this one is {capability[0]}.{capability[1]}")
    return torch.float8_e4m3fn


def resolve_device_settings(config: WorkerConfig) -> tuple[torch.device, torch.dtype, torch.dtype]:
    """`(device, dtype, kv_cache_dtype)` on this machine; ValueError, before any model is loaded,
    for settings its device cannot run (no CUDA for device="cuda", an fp8 KV cache on the CPU
    or an older GPU, an unknown dtype), naming the setting as the caller spelled it."""
    device = resolve_device(config.device, config.spell)
    dtype = resolve_dtype(config.dtype, device, config.spell)
    return device, dtype, resolve_kv_cache_dtype(config.kv_cache_dtype, dtype, device, config.spell)
