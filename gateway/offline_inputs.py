"""What `LLM` accepts: its engine arguments, prompts and sampling parameters, checked and put in
one form, with a clear ValueError for anything else."""

from __future__ import annotations

from spillway.gateway.sampling_params import SamplingParams
from spillway.gateway.tokenizer import PromptTokenizer
from spillway.worker.config import KV_CACHE_DTYPES

# vLLM arguments whose features Spillway does not have yet: refused, never silently ignored.
NOT_YET = {
    "cpu_offload_gb": "the CPU KV tier",
    "swap_space": "the CPU KV tier",
    "speculative_model": "speculative decoding",
    "speculative_config": "speculative decoding",
    "num_speculative_tokens": "speculative decoding",
    "quantization": "quantised execution",
    "enable_lora": "LoRA adapters",
}


def check_engine_args(block_size, max_num_seqs, max_model_len, max_num_batched_tokens, gpu_memory_utilization,
                      kv_cache_dtype) -> None:
    """`LLM`'s engine arguments, checked before a worker is started."""
    if block_size not in (8, 16, 32, 64, 128):
        raise ValueError(f"block_size must be one of 8, 16, 32, 64, 128, got {block_size!r}")
    if not isinstance(max_num_seqs, int) or max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be a positive integer, got {max_num_seqs!r}")
    if max_model_len is not None and (not isinstance(max_model_len, int) or max_model_len < 2):
        raise ValueError(f"max_model_len must be an integer of at least 2, got {max_model_len!r}")
    if max_num_batched_tokens is not None and (not isinstance(max_num_batched_tokens, int)
                                               or max_num_batched_tokens < 1):
        raise ValueError(f"max_num_batched_tokens must be a positive integer, got {max_num_batched_tokens!r}")
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization!r}")
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")


def require_tokenizer(tokenizer: PromptTokenizer | None) -> PromptTokenizer:
    if tokenizer is None:
        raise ValueError("this model has no tokenizer: pass prompts as token-id lists")
    return tokenizer


def normalize_prompts(prompts, tokenizer: PromptTokenizer | None, max_model_len: int,
                      vocab_size: int) -> list[tuple[str | None, list[int]]]:
    """`LLM.generate`'s prompts as (text or None, token ids) pairs, each checked."""
    if isinstance(prompts, (str, dict)) or (
        isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts)
    ):
        prompts = [prompts]
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts must be a string, a token-id list, or a non-empty list of them")
    items = []
    for prompt in prompts:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                prompt = list(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            items.append((prompt, require_tokenizer(tokenizer).encode(prompt)))
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool)
                                                       for t in prompt):
            items.append((None, list(prompt)))
        else:
            raise ValueError(f"unsupported prompt {prompt!r:.80}: expected a string or a list of token ids")
    for _, token_ids in items:
        check_prompt(token_ids, max_model_len, vocab_size)
    return items


def check_prompt(token_ids: list[int], max_model_len: int, vocab_size: int) -> None:
    if not token_ids:
        raise ValueError("a prompt is empty")
    if len(token_ids) >= max_model_len:
        raise ValueError(
            f"a prompt has {len(token_ids)} tokens, but max_model_len is {max_model_len} "
            "(the prompt plus at least one output token must fit)"
        )
    if min(token_ids) < 0 or max(token_ids) >= vocab_size:
        raise ValueError(f"prompt token ids must lie in [0, {vocab_size})")


def normalize_params(sampling_params, count: int) -> list[SamplingParams]:
    """One SamplingParams per prompt: the default, one for all, or a list of exactly `count`."""
    if sampling_params is None:
        return [SamplingParams()] * count
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * count
    params = list(sampling_params)
    if len(params) != count or not all(isinstance(p, SamplingParams) for p in params):
        raise ValueError(f"give one SamplingParams, or exactly one per prompt ({count})")
    return params
