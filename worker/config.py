"""The worker's start-up configuration: built by the gateway, sent to the worker as msgpack."""

from __future__ import annotations

import msgspec
import torch

from spillway.protocol.hashing import DEFAULT_HASH_SEED

# "auto": the model's dtype; "fp8" and "fp8_e4m3": float8 e4m3, unscaled (CUDA only).
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")


class WorkerConfig(msgspec.Struct, frozen=True, kw_only=True):
    """What a worker needs to start. Built by the gateway, sent to the worker process."""

    model: str | None = None
    served_model_name: str | None = None
    load_format: str = "auto"
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"  # one of KV_CACHE_DTYPES
    device: str = "auto"
    seed: int = 0
    block_size: int = 16
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    enforce_eager: bool = False  # no CUDA graphs: every step runs eagerly
    # Plan the next decode step while the device runs this one; None: on for CUDA.
    async_scheduling: bool | None = None
    hash_seed: bytes = DEFAULT_HASH_SEED


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={name!r} asked for, but no CUDA GPU is available")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    table = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
             "float16": torch.float16, "half": torch.float16}
    if name not in table:
        raise ValueError(f"unknown dtype {name!r}; choose one of auto, {', '.join(table)}")
    return table[name]


def resolve_kv_cache_dtype(name: str, dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The KV cache's dtype: the model's `dtype` for "auto", float8 e4m3 (unscaled) for "fp8"
    and "fp8_e4m3". Only on CUDA: the CPU's plain-torch attention stays exact to Hugging Face."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown kv_cache_dtype {name!r}; choose one of {', '.join(KV_CACHE_DTYPES)}")
    if name == "auto":
        return dtype
    if device.type != "cuda":
        raise ValueError(f"kv_cache_dtype={name!r}: an fp8 KV cache needs CUDA, and the device is {device}")
    capability = torch.cuda.get_device_capability(device)
    if capability < (8, 9):  # the kernels' e4m3 conversions are Ada / Hopper instructions
        raise ValueError(f"kv_cache_dtype={name!r}: an fp8 KV cache needs a GPU of compute capability 8.9 "
                         f"or newer (Ada, Hopper), and this one is {capability[0]}.{capability[1]}")
    return torch.float8_e4m3fn


def resolve_device_settings(config: WorkerConfig) -> tuple[torch.device, torch.dtype, torch.dtype]:
    """`(device, dtype, kv_cache_dtype)` on this machine; ValueError, before any model is loaded,
    for settings its device cannot run (no CUDA for device="cuda", an fp8 KV cache on the CPU
    or an older GPU, an unknown dtype)."""
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    return device, dtype, resolve_kv_cache_dtype(config.kv_cache_dtype, dtype, device)
