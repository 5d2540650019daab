"""The engine's logits and greedy tokens against Hugging Face transformers on the same weights:
the real default model (SmolLM2-135M-Instruct, fp32) and a tiny random Qwen3 (q/k norm path)."""

from __future__ import annotations

import pytest
import torch

from spillway.gateway import LLM, SamplingParams
from spillway.protocol.local import model_files
from spillway.worker.runner.model_runner import ChunkInput, ModelRunner
from spillway.worker.models import build_model, loader
from spillway.worker.models.cpu_linear import pack_linear_layers

BLOCK = 16


def engine_logits(model, prompts: list[list[int]], decode_tokens: list[int]):
    """Prefill every prompt in one batch, then one decode step with `decode_tokens`."""
    runner = ModelRunner(model, num_blocks=256, block_size=BLOCK, device=torch.device("cpu"), dtype=torch.float32)
    tables, next_block = [], 0
    for prompt in prompts:
        count = (len(prompt) + 1 + BLOCK - 1) // BLOCK
        tables.append(list(range(next_block, next_block + count))[::-1])  # non-contiguous, reversed
        next_block += count
    prefill = runner.execute([ChunkInput(p, 0, t) for p, t in zip(prompts, tables)])
    decode = runner.execute([ChunkInput([tok], len(p), t) for p, tok, t in zip(prompts, decode_tokens, tables)])
    return prefill, decode


def hf_logits(hf_model, prompts, decode_tokens):
    prefill, decode = [], []
    with torch.inference_mode():
        for prompt, tok in zip(prompts, decode_tokens):
            logits = hf_model(torch.tensor([prompt + [tok]])).logits[0].float()
            prefill.append(logits[-2])
            decode.append(logits[-1])
    return torch.stack(prefill), torch.stack(decode)


def test_default_model_logits_match_hf():
    from transformers import AutoModelForCausalLM

    files = loader.resolve_model(None)
    config = loader.load_config(files)
    model = build_model(config, device=torch.device("cpu"), dtype=torch.float32)
    model.load_weights(loader.iter_weights(files))
    tok = model_files.load_tokenizer(files)
    ids = tok("The quick brown fox jumps over the lazy dog. " * 80, add_special_tokens=False)["input_ids"]
    prompts = [ids[i: i + n] for i, n in enumerate([1, 7, 16, 33, 100, 257, 600, 31])]
    decode_tokens = [42, 7, 1000, 3, 9, 77, 5, 11]
    plain = engine_logits(model, prompts, decode_tokens)
    assert pack_linear_layers(model) == 4 * config.num_hidden_layers + 1  # as the engine does on the CPU
    packed = engine_logits(model, prompts, decode_tokens)
    hf = AutoModelForCausalLM.from_pretrained(files.path, dtype=torch.float32).eval()
    ref_prefill, ref_decode = hf_logits(hf, prompts, decode_tokens)
    for ours_prefill, ours_decode in (plain, packed):
        assert (ours_prefill - ref_prefill).abs().max().item() < 1e-3
        assert (ours_decode - ref_decode).abs().max().item() < 1e-3


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                         rms_norm_eps=1e-6, tie_word_embeddings=False, eos_token_id=1)
    model = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():  # norms away from 1, so the q/k norm path matters
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            else:
                param.normal_(0, 0.2)
    path = tmp_path_factory.mktemp("tiny-qwen3")
    model.save_pretrained(path)
    return path, model


def test_tiny_qwen3_logits_and_greedy_match_hf(tiny_qwen3):
    path, hf = tiny_qwen3
    files = loader.resolve_model(str(path))
    model = build_model(loader.load_config(files), device=torch.device("cpu"), dtype=torch.float32)
    model.load_weights(loader.iter_weights(files))
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, 512, (n,), generator=gen).tolist() for n in (1, 5, 16, 17, 40, 64, 100, 3)]
    decode_tokens = [5, 6, 7, 8, 9, 10, 11, 12]
    ours_prefill, ours_decode = engine_logits(model, prompts, decode_tokens)
    ref_prefill, ref_decode = hf_logits(hf, prompts, decode_tokens)
    assert (ours_prefill - ref_prefill).abs().max().item() < 1e-3
    assert (ours_decode - ref_decode).abs().max().item() < 1e-3

    with LLM(str(path), device="cpu", dtype="float32") as llm:
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                               use_tqdm=False)
    with torch.inference_mode():
        for prompt, out in zip(prompts, outputs):
            expected = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                   do_sample=False, max_new_tokens=12, min_new_tokens=12, pad_token_id=0)
            assert out.outputs[0].token_ids == expected[0, len(prompt):].tolist()
