"""Spillway: an LLM serving engine. `from spillway import LLM, SamplingParams`, as vLLM users write
`from vllm import LLM, SamplingParams`.

This folder is installed as the package `spillway` itself; the subsystems are its subpackages
(`spillway.gateway`, `spillway.worker`, `spillway.protocol`, `spillway.kernels`). The offline
API's names are loaded on first use, so a worker process that imports `spillway.worker` never
loads the gateway.
"""

from __future__ import annotations

import importlib

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "Logprob"]


def __getattr__(name: str):
    if name in __all__:
        return getattr(importlib.import_module("spillway.gateway"), name)
    raise AttributeError(f"module 'spillway' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
