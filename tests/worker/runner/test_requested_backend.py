"""The worker runs its own attention kernel for the backend a user named (vLLM's name, checked
by the gateway: tests/gateway/link/test_attention_backend.py) and says which, once, as it builds
the model: the kernel, and why it runs instead."""

from __future__ import annotations

import logging

import pytest

from spillway.protocol.config import WorkerConfig
from spillway.worker.attention.requested_backend import requested_backend_note
from spillway.worker.attention.torch_paged import TorchAttentionBackend
from spillway.worker.attention.triton_latent import LatentAttentionBackend
from spillway.worker.attention.triton_paged import TritonAttentionBackend
from spillway.worker.driver.engine import Engine

from tiny_models import save_tiny_deepseek_v3

TRITON_MLA_LINE = ("attention backend TRITON_MLA requested: Spillway's plain-torch latent attention runs (the CPU "
                   "runs plain torch; TRITON_MLA is vLLM's Triton latent-attention kernel)")


@pytest.fixture(scope="module")
def deepseek_v3(tmp_path_factory) -> str:
    return save_tiny_deepseek_v3(tmp_path_factory.mktemp("deepseek_v3"))


def test_the_worker_logs_the_requested_backend_once_as_it_builds_the_model(deepseek_v3, caplog):
    with caplog.at_level(logging.INFO, logger="spillway.worker"):
        Engine(WorkerConfig(model=deepseek_v3, dtype="float32", device="cpu", max_num_seqs=2, max_model_len=128,
                            attention_backend="TRITON_MLA"))
    assert [record.getMessage() for record in caplog.records if "attention backend" in record.getMessage()] == [
        TRITON_MLA_LINE]
    assert [record.levelno for record in caplog.records if record.getMessage() == TRITON_MLA_LINE] == [logging.INFO]


def test_the_worker_refuses_a_name_that_does_not_fit_before_it_loads_the_model(deepseek_v3):
    with pytest.raises(ValueError, match=r"^attention_backend='FLASH_ATTN': FLASH_ATTN is a kernel for models without "):
        Engine(WorkerConfig(model=deepseek_v3, dtype="float32", device="cpu", attention_backend="FLASH_ATTN"))


@pytest.mark.parametrize("backend, latent, line", [
    (TorchAttentionBackend(16), True,
     "attention backend TOKENSPEED_MLA requested: Spillway's plain-torch latent attention runs (the CPU runs "
     "plain torch; TOKENSPEED_MLA is vLLM's Blackwell-only kernel)"),
    (LatentAttentionBackend(16, 512, 0.1), True,
     "attention backend TOKENSPEED_MLA requested: Spillway's Triton latent attention runs (Spillway's own MLA kernels "
     "run on CUDA, tuned for Hopper; TOKENSPEED_MLA is vLLM's Blackwell-only kernel)"),
    (TritonAttentionBackend(16), False,
     "attention backend FLASH_ATTN requested: Spillway's Triton paged attention runs (Spillway's own kernels run on "
     "CUDA; FLASH_ATTN is vLLM's FlashAttention kernel)"),
    (TorchAttentionBackend(16), False,
     "attention backend FLASH_ATTN requested: Spillway's plain-torch paged attention runs (the CPU runs plain torch; "
     "FLASH_ATTN is vLLM's FlashAttention kernel)"),
])
def test_the_note_names_the_kernel_that_runs_for_the_device_and_model(backend, latent, line):
    requested = "TOKENSPEED_MLA" if latent else "FLASH_ATTN"
    assert requested_backend_note(requested, backend, latent=latent) == line
