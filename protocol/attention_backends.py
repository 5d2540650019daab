"""The attention backends vLLM users name, with `--attention-backend NAME` or
`--additional-config '{"mla_backend": "NAME"}'`, and which of them fit a model.

Spillway has one attention kernel per device and kind of model (worker/attention/): it takes a
name vLLM would take for the model and runs its own kernel, saying which once in the worker's
log (worker/attention/requested_backend.py). A name that does not fit the model is refused: a
latent-attention (MLA) kernel for a model without it, or the other way round, which vLLM
refuses too. The names are vLLM's `AttentionBackendEnum` members', as written there.
Imports only the standard library.
"""

from __future__ import annotations

from collections.abc import Mapping

# vLLM's kernels for multi-head latent attention (DeepSeek V2/V3): name -> what it is there.
MLA_BACKENDS = {
    "FLASH_ATTN_MLA": "vLLM's FlashAttention 3 latent-attention kernel (Hopper)",
    "FLASHMLA": "vLLM's FlashMLA kernel (Hopper and Blackwell)",
    "FLASHINFER_MLA": "vLLM's FlashInfer latent-attention kernel (Blackwell)",
    "TRITON_MLA": "vLLM's Triton latent-attention kernel",
    "CUTLASS_MLA": "vLLM's CUTLASS latent-attention kernel (Blackwell)",
    "TOKENSPEED_MLA": "vLLM's Blackwell-only kernel",
    "FLASHMLA_SPARSE": "vLLM's FlashMLA sparse-attention kernel",
    "FLASHINFER_MLA_SPARSE": "vLLM's FlashInfer sparse-attention kernel",
    "TRITON_MLA_SPARSE": "vLLM's Triton sparse-attention kernel",
    "ROCM_AITER_MLA": "vLLM's AITER latent-attention kernel (AMD)",
    "ROCM_AITER_TRITON_MLA": "vLLM's AITER Triton latent-attention kernel (AMD)",
    "ROCM_AITER_MLA_SPARSE": "vLLM's AITER sparse-attention kernel (AMD)",
    "XPU_MLA_SPARSE": "vLLM's sparse-attention kernel for Intel GPUs",
}
# vLLM's kernels for models with query, key and value heads.
DENSE_BACKENDS = {
    "FLASH_ATTN": "vLLM's FlashAttention kernel",
    "FLASH_ATTN_DIFFKV": "vLLM's FlashAttention kernel for keys and values of different widths",
    "TRITON_ATTN": "vLLM's Triton paged-attention kernel",
    "FLASHINFER": "vLLM's FlashInfer kernel",
    "FLEX_ATTENTION": "vLLM's FlexAttention backend (torch.compile)",
    "TREE_ATTN": "vLLM's tree attention for speculative decoding",
    "CPU_ATTN": "vLLM's CPU attention",
    "ROCM_ATTN": "vLLM's ROCm paged-attention kernel (AMD)",
    "ROCM_AITER_FA": "vLLM's AITER FlashAttention kernel (AMD)",
    "ROCM_AITER_UNIFIED_ATTN": "vLLM's AITER unified attention kernel (AMD)",
}
BACKEND_NAMES = (*DENSE_BACKENDS, *MLA_BACKENDS)
# The keys of `--additional-config` Spillway understands; vLLM hands the others to platform plugins.
ADDITIONAL_CONFIG_KEYS = ("mla_backend",)


def uses_latent_attention(config: Mapping) -> bool:
    """Whether the model of Hugging Face `config` (a config.json's values) attends through a
    latent KV row (MLA: DeepSeek V2/V3, whose configs alone carry `kv_lora_rank`)."""
    return bool(config.get("kv_lora_rank"))


def backend_description(name: str) -> str:
    return MLA_BACKENDS.get(name) or DENSE_BACKENDS[name]


def fitting_backends(latent: bool) -> tuple[str, ...]:
    """The names a model with (`latent`) or without multi-head latent attention takes."""
    return tuple(MLA_BACKENDS if latent else DENSE_BACKENDS)


def backend_problem(name: str, latent: bool) -> str | None:
    """Why a model with (`latent`) or without latent attention cannot take the backend `name`, or None."""
    if name not in BACKEND_NAMES:
        return f"vLLM has no attention backend {name!r}; the model takes {', '.join(fitting_backends(latent))}"
    if (name in MLA_BACKENDS) != latent:
        kind = "a latent-attention (MLA) kernel" if name in MLA_BACKENDS else "a kernel for models without " \
                                                                              "latent attention (MLA)"
        model = "uses multi-head latent attention" if latent else "has no latent attention"
        return f"{name} is {kind} and the model {model}; it takes {', '.join(fitting_backends(latent))}"
    return None
