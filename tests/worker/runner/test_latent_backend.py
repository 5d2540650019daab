"""The latent attention backend (worker/attention/triton_latent.py: the MLA kernels, interpreted
on the CPU) runs a tiny DeepSeek V2 and V3 as the plain-torch backend does: chunked, batched
prefill beside decodes, then decode-only steps; logits within 1e-4 in float32, the same
greedy tokens, the same latent rows in the cache. So does the whole GPU path: the backend with
the model's other operations through their kernels too (norms, rotary in place, router, experts)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_deepseek_v2, tiny_deepseek_v3

from spillway.worker.attention.triton_latent import LatentAttentionBackend
from spillway.protocol.local import model_files
from spillway.worker.models import loader
from spillway.worker.models.layers import kernel_ops
from spillway.worker.models.llama import LlamaForCausalLM
from spillway.worker.runner.model_runner import ModelRunner
from tests.worker.models.test_moe_models import BLOCK_SIZE, CPU, TOLERANCE, chunked_greedy, load, random_prompts

# The kernels' dot products take a rope part of 16 values or more (the released models: 64).
FAMILIES = {"deepseek_v2": tiny_deepseek_v2, "deepseek_v3": tiny_deepseek_v3}


@pytest.fixture(scope="module", params=FAMILIES)
def saved(request, tmp_path_factory):
    hf = FAMILIES[request.param](qk_rope_head_dim=16)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return path, hf


def test_the_kernels_give_the_plain_torch_logits_and_cache(saved):
    path, hf = saved
    runners = {}
    for name in ("torch", "latent", "kernels"):
        model = load_with_kernel_ops(path) if name == "kernels" else load(path)
        mla = model.spec.mla
        backend = (LatentAttentionBackend(BLOCK_SIZE, mla.kv_lora_rank, scale=model.attention_scale)
                   if name != "torch" else None)
        runners[name] = ModelRunner(model, num_blocks=80, block_size=BLOCK_SIZE, device=CPU, dtype=torch.float32,
                                    backend=backend)
    prompts = random_prompts((3, 11, 18, 26), hf.config.vocab_size, seed=3)
    results = {name: chunked_greedy(runner, prompts, budget=10, new_tokens=5) for name, runner in runners.items()}

    expected, expected_logits = results["torch"]
    for name in ("latent", "kernels"):
        got, got_logits = results[name]
        assert got == expected, name
        for want, have in zip(expected_logits, got_logits):
            assert sorted(have) == sorted(want)
            for position in want:
                assert (have[position] - want[position]).abs().max().item() < TOLERANCE, (name, position)
        assert (runners[name].kv_cache - runners["torch"].kv_cache).abs().max().item() < TOLERANCE, name


def load_with_kernel_ops(path) -> torch.nn.Module:
    """`load`, with the GPU's operations (interpreted here)."""
    files = model_files.resolve_model(str(path))
    model = LlamaForCausalLM.build(model_files.load_config(files), device=CPU, dtype=torch.float32, ops=kernel_ops())
    model.load_weights(loader.iter_weights(files))
    return model


def test_values_for_a_latent_cache_are_refused():
    backend = LatentAttentionBackend(BLOCK_SIZE, 32, scale=0.1)
    rows = torch.zeros(2, 1, 48)
    with pytest.raises(ValueError, match="v must be None"):
        backend.forward(0, torch.zeros(2, 4, 48), rows, rows, torch.zeros(4, 1, 1, BLOCK_SIZE, 1, 48), None)
