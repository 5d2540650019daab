"""What runs for the attention backend a user named (vLLM's names, protocol/attention_backends.py):
Spillway's own kernel for the device and the model, said once in the worker's log.

    Triton paged attention        a model without latent attention, on CUDA
    plain-torch paged attention   a model without latent attention, on the CPU
    Triton latent attention       an MLA model (DeepSeek V2/V3), on CUDA (kernels/mla_decode.py)
    plain-torch latent attention  an MLA model, on the CPU
"""

from __future__ import annotations

from spillway.protocol.attention_backends import backend_description
from spillway.worker.attention.torch_paged import AttentionBackend, TorchAttentionBackend


def requested_backend_note(requested: str, backend: AttentionBackend, *, latent: bool) -> str:
    """The log line for `requested` (a name the gateway checked against the model) when
    `backend` runs a model with (`latent`) or without multi-head latent attention."""
    if latent and isinstance(backend, TorchAttentionBackend):
        kernel, why = "plain-torch latent attention", "the CPU runs plain torch"
    elif latent:
        kernel, why = "Triton latent attention", "Spillway's own MLA kernels run on CUDA, tuned for Hopper"
    elif isinstance(backend, TorchAttentionBackend):
        kernel, why = "plain-torch paged attention", "the CPU runs plain torch"
    else:
        kernel, why = "Triton paged attention", "Spillway's own kernels run on CUDA"
    return (f"attention backend {requested} requested: Spillway's {kernel} runs "
            f"({why}; {requested} is {backend_description(requested)})")
