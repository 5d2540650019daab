"""The values of an OpenAI request checked: features Spillway lacks refused with a 400 naming
the field, the sampling fields turned into SamplingParams, the prompts listed.

A field of vLLM's that Spillway has no feature for is refused when it is set to anything but
its neutral value (None, empty, or the field's default), so a client never gets an answer that
quietly ignored what it asked for.
"""

from __future__ import annotations

from functools import cache

import msgspec

from spillway.gateway.api.openai import ChatCompletionRequest, CompletionRequest, bad_request
from spillway.gateway.api.prompt_ids import PROMPT_SHAPES, Prompt, token_id_prompt
from spillway.gateway.api.sampling_params import MAX_LOGPROBS, MAX_N, SamplingParams
from spillway.gateway.api.structured_outputs import StructuredOutputsParams, from_fields, from_response_format

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 128
MAX_STOP_TOKEN_IDS = 256
INT64_MAX = 2**63 - 1
MAX_TOKEN_ID = 2**31 - 1

# Field -> why it is refused when set. Both endpoints, then each one's own.
REFUSED = {
    "use_beam_search": "beam search is not supported",
    "length_penalty": "length_penalty applies to beam search, which is not supported",
    "spaces_between_special_tokens": "only spaces_between_special_tokens=true is supported "
                                     "(fast tokenizers, the only kind served, ignore it)",
    "logit_bias": "logit_bias is not supported",
    "allowed_token_ids": "allowed_token_ids is not supported",
    "bad_words": "bad_words is not supported",
    "logits_processors": "logits_processors are not supported",
    "vllm_xargs": "vllm_xargs (arguments for custom logits processors) are not supported",
    "guided_whitespace_pattern": "guided_whitespace_pattern is not supported (structured_outputs' "
                                 "disable_any_whitespace is)",
}
# vLLM's older names for structured_outputs' fields.
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar", "structural_tag": "structural_tag"}
REFUSED_CHAT = {
    "echo": "echo is not supported for chat completions",
    "include_reasoning": "include_reasoning=false is not supported",
    "mm_processor_kwargs": "multimodal inputs are not supported",
    "media_io_kwargs": "multimodal inputs are not supported",
}
REFUSED_COMPLETION = {
    "echo": "echo is not supported",
    "suffix": "suffix is not supported",
    "prompt_embeds": "prompt_embeds are not supported",
}


@cache
def _defaults(request_type: type) -> dict[str, object]:
    return {f.name: f.default for f in msgspec.structs.fields(request_type)}


def check_unsupported(request: ChatCompletionRequest | CompletionRequest) -> None:
    """A 400 naming the first field set that asks for a feature Spillway does not have."""
    chat = isinstance(request, ChatCompletionRequest)
    defaults = _defaults(type(request))
    for name, reason in (REFUSED | (REFUSED_CHAT if chat else REFUSED_COMPLETION)).items():
        value = getattr(request, name)
        if value is not None and value != {} and value != [] and value != defaults[name]:
            raise bad_request(f"{name}: {reason}", param=name)
    if request.best_of is not None and request.best_of != (request.n or 1):
        raise bad_request("best_of other than n is not supported", param="best_of")
    # A chat request's tools and tool_choice: gateway/api/tool_choice.py.


def structured_outputs(request: ChatCompletionRequest | CompletionRequest) -> StructuredOutputsParams | None:
    """The one constraint a request asks for, from `structured_outputs`, `response_format` or
    the `guided_*` fields (at most one of the three ways); a ValueError becomes a 400."""
    asked = {}
    if request.structured_outputs:
        asked["structured_outputs"] = lambda: from_fields(request.structured_outputs, "structured_outputs")
    if request.response_format is not None and request.response_format.type != "text":
        asked["response_format"] = lambda: from_response_format(request.response_format)
    guided = {GUIDED_FIELDS[name]: getattr(request, name) for name in GUIDED_FIELDS
              if getattr(request, name) not in (None, [], {})}
    if guided:
        first = next(name for name in GUIDED_FIELDS if GUIDED_FIELDS[name] in guided)
        asked[first] = lambda: StructuredOutputsParams(**guided)
    if len(asked) > 1:
        raise bad_request(f"{' and '.join(asked)} both constrain the output: send one", param=next(iter(asked)))
    if not asked:
        return None
    (name, build), = asked.items()
    try:
        return build()
    except ValueError as exc:
        raise bad_request(f"{name}: {exc}", param=name) from None


def sampling_params(request: ChatCompletionRequest | CompletionRequest, max_tokens: int | None,
                    logprobs: int | None) -> SamplingParams:
    """The request's sampling fields, checked (ranges, limits); a ValueError becomes a 400."""
    stop = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
    if len(stop) > MAX_STOP_STRINGS:
        raise bad_request(f"at most {MAX_STOP_STRINGS} stop strings are allowed", param="stop")
    if any(len(s) > MAX_STOP_STRING_CHARS for s in stop):
        raise bad_request(f"a stop string may have at most {MAX_STOP_STRING_CHARS} characters", param="stop")
    if len(request.stop_token_ids or ()) > MAX_STOP_TOKEN_IDS:
        raise bad_request(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids are allowed", param="stop_token_ids")
    for name in ("seed", "top_k", "min_tokens", "priority", "thinking_budget", "thinking_token_budget",
                 "truncate_prompt_tokens"):
        value = getattr(request, name)
        if value is not None and not -INT64_MAX - 1 <= value <= INT64_MAX:
            raise bad_request(f"{name} must fit in a signed 64-bit integer", param=name)
    if max_tokens is not None and not -INT64_MAX - 1 <= max_tokens <= INT64_MAX:
        raise bad_request("max_tokens must fit in a signed 64-bit integer", param="max_tokens")
    if any(not 0 <= t <= MAX_TOKEN_ID for t in request.stop_token_ids or ()):
        raise bad_request(f"stop_token_ids must lie in [0, {MAX_TOKEN_ID}]", param="stop_token_ids")
    if request.n is not None and request.n > MAX_N:
        raise bad_request(f"n must be at most {MAX_N}", param="n")
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        name = "top_logprobs" if isinstance(request, ChatCompletionRequest) else "logprobs"
        raise bad_request(f"{name} must be in [0, {MAX_LOGPROBS}], got {logprobs}", param=name)
    if request.prompt_logprobs is not None and not 0 <= request.prompt_logprobs <= MAX_LOGPROBS:
        raise bad_request(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {request.prompt_logprobs}",
                          param="prompt_logprobs")
    if request.prompt_logprobs is not None and request.stream:
        raise bad_request("prompt_logprobs are not available when stream is true (as in vLLM)",
                          param="prompt_logprobs")
    if request.truncate_prompt_tokens is not None and not (request.truncate_prompt_tokens >= 1
                                                           or request.truncate_prompt_tokens == -1):
        raise bad_request("truncate_prompt_tokens must be a positive number of tokens, or -1 (the model's "
                          "context length)", param="truncate_prompt_tokens")
    try:
        return SamplingParams(
            n=1 if request.n is None else request.n,
            temperature=1.0 if request.temperature is None else request.temperature,
            top_p=1.0 if request.top_p is None else request.top_p,
            top_k=0 if request.top_k is None else request.top_k,
            min_p=0.0 if request.min_p is None else request.min_p,
            presence_penalty=request.presence_penalty or 0.0,
            frequency_penalty=request.frequency_penalty or 0.0,
            repetition_penalty=1.0 if request.repetition_penalty is None else request.repetition_penalty,
            seed=request.seed,
            stop=stop,
            stop_token_ids=list(request.stop_token_ids or []),
            ignore_eos=request.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=request.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=request.prompt_logprobs,
            skip_special_tokens=request.skip_special_tokens,
            include_stop_str_in_output=request.include_stop_str_in_output,
            thinking_budget=request.thinking_budget,
            thinking_token_budget=request.thinking_token_budget,
            structured_outputs=structured_outputs(request),
        )
    except ValueError as exc:
        message = str(exc)
        first_word = message.split(" ", 1)[0]
        param = first_word if first_word in request.__struct_fields__ else None
        raise bad_request(message, param=param) from None


def chat_logprobs(request: ChatCompletionRequest) -> int | None:
    if not request.logprobs:
        if request.top_logprobs:
            raise bad_request("top_logprobs needs logprobs: true", param="top_logprobs")
        return None
    return request.top_logprobs or 0


def completion_prompts(prompt) -> list[str | Prompt]:
    """A completions prompt is a string, a token-id list, or a list of either; id lists come
    back as Prompts (one of ids alone is packed already, see gateway/api/prompt_ids.py)."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request("prompt must not be empty", param="prompt")
    if isinstance(prompt[0], int):
        return [token_id_prompt(prompt)]
    kinds = set(map(type, prompt))  # one pass in C
    if kinds == {str}:
        return list(prompt)
    if kinds == {list}:
        return [Prompt(ids) for ids in prompt]
    raise bad_request(PROMPT_SHAPES, param="prompt")
