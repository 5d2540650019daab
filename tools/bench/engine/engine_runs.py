"""One request at a time through an `Engine` on the GPU (or the CPU), dummy weights of a built-in config: the
engine, its batch-1 decode rate, and the weight bytes a decode step reads (its floor).
tools/bench/engine/engine.py's decode and prefill rows use them."""

from __future__ import annotations

import random
import time


def make_engine(name: str, max_model_len: int, num_blocks: int, enforce_eager: bool = False,
                quantization: str | None = None, device: str = "cuda"):
    """An engine for one request at a time, its KV pool fixed (no profiling run): bfloat16 on
    CUDA, float32 on the CPU; `quantization` "fp8": the projections' weights in FP8."""
    from spillway.protocol.local.envs import worker_config_from_env
    from spillway.worker.driver.engine import Engine

    dtype = "float32" if device == "cpu" else "bfloat16"
    return Engine(worker_config_from_env(model=name, load_format="dummy", dtype=dtype, device=device,
                                         max_model_len=max_model_len, max_num_seqs=1,
                                         num_gpu_blocks_override=num_blocks, enforce_eager=enforce_eager,
                                         quantization=quantization))


def decode_ms_per_token(engine, prompt_len: int, new_tokens: int, request_id: str) -> float:
    """Wall ms per decoded token of one greedy request, driving Engine.step() (the prefill
    step and its first token excluded; with async scheduling a step's token comes back from
    the next call, so tokens are counted, not calls)."""
    import torch

    from spillway.protocol.messages import Generate, SamplingParams

    rng = random.Random(0)
    prompt = [rng.randrange(256, engine.vocab_size) for _ in range(prompt_len)]
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    engine.add_request(Generate(request_id=request_id, prompt_token_ids=prompt, block_hashes=[], params=params))
    first = 0
    while not first:  # the prefill and the first token (a call later when the prefill ran ahead)
        first = sum(len(d.new_token_ids) for d in engine.step())
    assert first == 1, first
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    started, tokens = time.perf_counter(), 0
    while engine.has_work:
        tokens += sum(len(d.new_token_ids) for d in engine.step())
    assert tokens == new_tokens - 1, tokens
    return (time.perf_counter() - started) / tokens * 1e3


# The stacked experts' parameters, of which a token reads its top_k experts' rows only (fp8 ones'
# row scales included).
EXPERT_STACKS = ("experts.gate_up_proj", "experts.down_proj", "experts.gate_up_proj_scale",
                 "experts.down_proj_scale")


def weight_bytes_per_token(model) -> int:
    """Bytes of weights a batch-1 decode step reads: all but the embedding table (unless it is
    lm_head), and of each mixture-of-experts layer only the experts one token is routed to.
    On the CPU the packed linear layers (oneDNN's layout, no parameters) count in the model's
    dtype; FP8 projections and experts count a byte a weight."""
    moe = getattr(model.spec, "moe", None)
    embedding = model.model.embed_tokens.weight
    tied = model.spec.tie_word_embeddings
    total = 0
    for name, param in model.named_parameters():
        size = param.numel() * param.element_size()
        if moe is not None and name.endswith(EXPERT_STACKS):
            size = size * moe.top_k // param.shape[0]
        total += size
    for name, module in model.named_modules():
        if hasattr(module, "packed_weight") and not (tied and name.startswith("lm_head")):
            total += module.in_features * module.out_features * embedding.element_size()
    return total if tied else total - embedding.numel() * embedding.element_size()
