"""The Hugging Face baselines of tools/bench/engine/engine.py, on the engine's own dummy weights. Each
runs in a child process of the benchmark, so an HF failure cannot take Spillway's figures."""

from __future__ import annotations

import time


def hf_static_compile_ms_per_token(name: str, new_tokens: int, seed: int = 0) -> dict:
    """HF `generate` with a static cache, which HF compiles itself (torch.compile, CUDA graphs).

    Runs in this (child) process: the weights are the engine's dummy weights for `name`
    (same initialiser, same seed) copied into the HF model. The prompt is one token; the
    time is the whole generate call over `new_tokens`, after warm-up calls that compile.
    """
    import torch

    from transformers import AutoModelForCausalLM

    from spillway.worker.models import build_model, loader

    hf_config = loader.load_config(loader.resolve_model(name, "dummy"))
    ours = build_model(hf_config, device=torch.device("cuda"), dtype=torch.bfloat16)
    loader.init_dummy_weights(ours, seed=seed)
    with torch.device("cuda"):
        hf = AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16).eval()
    state = hf.state_dict()
    with torch.no_grad():
        for weight_name, tensor in ours.checkpoint_weights():
            state[weight_name].copy_(tensor)
    del ours
    torch.cuda.empty_cache()
    input_ids = torch.tensor([[min(1000, hf_config.vocab_size - 1)]], device="cuda")
    kwargs = dict(attention_mask=torch.ones_like(input_ids), do_sample=False, max_new_tokens=new_tokens,
                  min_new_tokens=new_tokens, cache_implementation="static", pad_token_id=0)
    with torch.inference_mode():
        for _ in range(3):  # compile, record the graphs, then one clean run
            hf.generate(input_ids, **kwargs)
        torch.cuda.synchronize()
        started = time.perf_counter()
        out = hf.generate(input_ids, **kwargs)
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - started
    assert out.shape[1] == 1 + new_tokens, out.shape
    return {"ms_per_token": elapsed / new_tokens * 1e3}


def hf_generate_batch(prompts: list[list[int]], output_len: int) -> tuple[float | None, str]:
    """Output tokens/s of HF continuous batching on `prompts` (random weights, same shape)."""
    import torch

    from transformers import AutoModelForCausalLM, GenerationConfig

    from spillway.worker.models import loader

    hf_config = loader.load_config(loader.resolve_model("qwen3-8b", "dummy"))
    try:
        with torch.device("cuda"):
            hf = AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16).eval()
        config = GenerationConfig(max_new_tokens=output_len, do_sample=False, pad_token_id=0)
        warm_up = GenerationConfig(max_new_tokens=8, do_sample=False, pad_token_id=0)
        hf.generate_batch(inputs=prompts[:2], generation_config=warm_up)
        started = time.perf_counter()
        results = hf.generate_batch(inputs=prompts, generation_config=config)
        elapsed = time.perf_counter() - started
    except Exception as exc:
        return None, f"failed: {exc!r:.200}"
    generated = sum(len(r.generated_tokens) for r in results.values())
    return generated / elapsed, f"{len(prompts)} x ({len(prompts[0])} in, {output_len} out), {elapsed:.1f} s"
