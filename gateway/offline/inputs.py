"""What `LLM` accepts: its prompts and sampling parameters, checked and put in one form, with a
clear ValueError for anything else (its engine arguments: engine_args.py)."""

from __future__ import annotations

from spillway.gateway.api.sampling_params import SamplingParams
from spillway.gateway.text.tokenizer import PromptTokenizer


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
