"""An fp8 (float8 e4m3) KV cache: the option's names, the pool's sizing, the runner's kernel
path over an fp8 cache (on the CPU through Triton's interpreter) and, on a GPU, the whole
engine against its own run with the model's dtype in the cache.

The CPU's plain-torch attention stays exact to Hugging Face: there, fp8 is refused.
"""

from __future__ import annotations

import random

import pytest
import torch
import transformers

from spillway.kernels.fp8 import convert_cache
from spillway.worker.runner.device_settings import WorkerConfig
from spillway.worker.runner.device_settings import resolve_kv_cache_dtype
from spillway.worker.driver.engine import Engine
from spillway.worker.runner.kv_blocks import kv_block_bytes, num_blocks_for_memory
from spillway.worker.runner.model_runner import ChunkInput, ModelRunner
from spillway.worker.models.llama import LlamaForCausalLM

CPU = torch.device("cpu")
FP8 = torch.float8_e4m3fn
BLOCK = 16
VOCAB = 300


def random_qwen3(*, vocab: int = VOCAB, hidden: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                 head_dim: int = 32, max_positions: int = 256, seed: int = 0) -> transformers.Qwen3ForCausalLM:
    """A random HF Qwen3 on the CPU, weights large enough that greedy tokens are not near-ties."""
    config = transformers.Qwen3Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        max_position_embeddings=max_positions, rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(seed)
    hf = transformers.Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            param.uniform_(0.5, 1.5) if "norm" in name else param.normal_(0.0, 0.2)
    return hf


def kernel_runner(hf, kv_cache_dtype: torch.dtype | None) -> ModelRunner:
    """Our model on the Triton kernels (the CUDA path), float32, run on the CPU."""
    from spillway.worker.attention.triton_paged import TritonAttentionBackend
    from spillway.worker.models.layers import kernel_ops

    model = LlamaForCausalLM.build(hf.config, device=CPU, dtype=torch.float32, ops=kernel_ops())
    model.load_weights(hf.state_dict().items())
    return ModelRunner(model, num_blocks=24, block_size=BLOCK, device=CPU, dtype=torch.float32,
                       kv_cache_dtype=kv_cache_dtype, backend=TritonAttentionBackend(BLOCK), max_num_seqs=4,
                       max_num_batched_tokens=128, max_model_len=128)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out - ref).norm() / ref.norm())


def test_kv_cache_dtype_names(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))  # an H100 / H200
    assert resolve_kv_cache_dtype("auto", torch.bfloat16, CPU) == torch.bfloat16
    assert resolve_kv_cache_dtype("auto", torch.float32, torch.device("cuda")) == torch.float32
    assert resolve_kv_cache_dtype("fp8", torch.bfloat16, torch.device("cuda")) == FP8
    assert resolve_kv_cache_dtype("fp8_e4m3", torch.float16, torch.device("cuda")) == FP8
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8_e5m2': unknown kv_cache_dtype; choose one of auto, fp8, fp8_e4m3"):
        resolve_kv_cache_dtype("fp8_e5m2", torch.bfloat16, torch.device("cuda"))


def test_an_fp8_cache_needs_ada_or_hopper(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))  # an A100
    with pytest.raises(ValueError, match="compute capability 8.9 or newer .* this one is 8.0"):
        resolve_kv_cache_dtype("fp8", torch.bfloat16, torch.device("cuda"))
    assert resolve_kv_cache_dtype("auto", torch.bfloat16, torch.device("cuda")) == torch.bfloat16


@pytest.mark.parametrize("name", ["fp8", "fp8_e4m3", "float16"])
def test_the_engine_refuses_fp8_on_the_cpu_and_unknown_names_before_loading_the_model(name):
    message = "unknown kv_cache_dtype" if name == "float16" else "fp8 KV cache needs CUDA"
    with pytest.raises(ValueError, match=message):
        Engine(WorkerConfig(model="/no/such/model", device="cpu", kv_cache_dtype=name))


def test_the_plain_torch_attention_refuses_an_fp8_cache():
    hf = random_qwen3()
    model = LlamaForCausalLM.build(hf.config, device=CPU, dtype=torch.float32)
    with pytest.raises(ValueError, match="fp8 KV cache needs CUDA"):
        ModelRunner(model, num_blocks=4, block_size=BLOCK, device=CPU, dtype=torch.float32, kv_cache_dtype=FP8)


def test_an_fp8_block_takes_half_the_bytes_so_twice_the_blocks_fit():
    config = random_qwen3(layers=3).config
    # 3 layers x (k, v) x 16 tokens x 2 kv heads x 32 dims x 1 byte
    assert kv_block_bytes(config, 16, FP8) == 3 * 2 * 16 * 2 * 32
    assert kv_block_bytes(config, 16, torch.bfloat16) == 2 * kv_block_bytes(config, 16, FP8)
    budget = 10 * kv_block_bytes(config, 16, torch.bfloat16) + kv_block_bytes(config, 16, FP8)
    assert num_blocks_for_memory(config, 16, torch.bfloat16, budget) == 10
    assert num_blocks_for_memory(config, 16, FP8, budget) == 21


def test_kernel_path_over_an_fp8_cache_stores_e4m3_and_stays_near_the_exact_cache():
    hf = random_qwen3()
    exact, fp8 = kernel_runner(hf, None), kernel_runner(hf, FP8)
    assert exact.kv_cache.dtype == torch.float32 and fp8.kv_cache.dtype == FP8
    rng = random.Random(1)
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (5, 16, 33)]
    tables = [[0, 9], [3, 17, 4], [11, 2, 7, 20]]
    chunks = [ChunkInput(p, 0, t) for p, t in zip(prompts, tables)]
    expected, logits = exact.execute(chunks), fp8.execute(chunks)
    # Layer 0's keys and values come before any attention: the fp8 cache holds exactly their cast.
    layer0 = convert_cache(exact.kv_cache, FP8)[:, 0]
    assert torch.equal(fp8.kv_cache[:, 0].view(torch.uint8), layer0.view(torch.uint8))

    errors = [relative_error(logits, expected)]
    agreeing = [logits.argmax(-1) == expected.argmax(-1)]
    sequences = [p + [token] for p, token in zip(prompts, expected.argmax(-1).tolist())]
    for _ in range(3):  # decode steps (the decode kernel), both fed the exact run's tokens
        chunks = [ChunkInput([s[-1]], len(s) - 1, t) for s, t in zip(sequences, tables)]
        expected, logits = exact.execute(chunks), fp8.execute(chunks)
        errors.append(relative_error(logits, expected))
        agreeing.append(logits.argmax(-1) == expected.argmax(-1))
        for s, token in zip(sequences, expected.argmax(-1).tolist()):
            s.append(token)
    rate = float(torch.cat(agreeing).float().mean())
    summary = f"logits' relative error per step {[f'{e:.4f}' for e in errors]}, argmax agrees on {rate:.0%}"
    # Large random weights amplify the rounding: about 5% here; a misread cache would give ~100%.
    assert all(1e-4 < error < 0.2 for error in errors), summary
    assert rate >= 0.75, summary


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_fp8_cache_doubles_the_pool_and_greedy_tokens_stay_close_to_the_bf16_cache(tmp_path):
    """The same random Qwen3 behind `LLM` in bf16 with CUDA graphs, its cache once bf16, once
    fp8, with the same memory budget. 8 KV heads of 128 and max_model_len 32768 make the budget,
    not max_num_seqs x max_model_len, size both pools.

    Greedy outputs are compared as vLLM compares its fp8 KV cache with the model's dtype: the two
    runs agree token for token until the first difference, and there each run's token must be
    among the other run's top 5 (a near-tie flipped by rounding, not a misread cache); the
    sequences are not compared past it."""
    from spillway.gateway import LLM, SamplingParams

    num_steps, top = 8, 5
    hf = random_qwen3(vocab=1024, hidden=256, layers=4, heads=16, kv_heads=8, head_dim=128, max_positions=32768,
                      seed=3)
    hf.to(torch.bfloat16).save_pretrained(tmp_path)
    rng = random.Random(4)
    prompts = [[rng.randrange(1024) for _ in range(rng.randrange(1, 200))] for _ in range(32)]
    params = SamplingParams(temperature=0, max_tokens=num_steps, ignore_eos=True, logprobs=top)
    # The worker may take what this process (earlier tests) leaves: 25% of the card past it.
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    utilization = (total - free) / total + 0.25
    blocks, runs = {}, {}
    for kv_cache_dtype in ("auto", "fp8"):
        with LLM(str(tmp_path), dtype="bfloat16", kv_cache_dtype=kv_cache_dtype,
                 gpu_memory_utilization=utilization) as llm:
            blocks[kv_cache_dtype] = llm.ready.num_gpu_blocks
            runs[kv_cache_dtype] = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]

    ratio = blocks["fp8"] / blocks["auto"]
    agreeing, failures = [], []
    for i, (fp8, exact) in enumerate(zip(runs["fp8"], runs["auto"])):
        assert len(fp8.token_ids) == num_steps and all(
            torch.isfinite(torch.tensor([lp.logprob for lp in step.values()])).all() for step in fp8.logprobs)
        same = next((j for j, (a, b) in enumerate(zip(fp8.token_ids, exact.token_ids)) if a != b), num_steps)
        agreeing.append(same)
        if same < num_steps:
            a, b = fp8.token_ids[same], exact.token_ids[same]
            if a not in exact.logprobs[same] or b not in fp8.logprobs[same]:
                failures.append((i, same, a, b))
    summary = (f"KV blocks: fp8 {blocks['fp8']}, bf16 {blocks['auto']} ({ratio:.3f}x); {len(prompts)} prompts x "
               f"{num_steps} greedy tokens: identical on {agreeing.count(num_steps)}, mean agreeing prefix "
               f"{sum(agreeing) / len(agreeing):.1f}; first differences outside the other's top {top}: {failures}")
    print(summary)
    assert 1.9 <= ratio <= 2.1, summary
    assert not failures, summary
