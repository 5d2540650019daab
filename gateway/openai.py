"""OpenAI request bodies, their validation, and error bodies (answers: gateway/answers.py).

Requests are decoded by msgspec straight into typed Structs, so a wrong type is a 400 that
names the field. Unknown fields are ignored (clients send many optional ones), but fields for
features Spillway does not have (tools, logit_bias, JSON response formats, ...) are refused
rather than silently dropped.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

from spillway.gateway.sampling_params import MAX_LOGPROBS, MAX_N, SamplingParams

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 128
MAX_STOP_TOKEN_IDS = 256
INT64_MAX = 2**63 - 1
MAX_TOKEN_ID = 2**31 - 1
ROLES = ("system", "developer", "user", "assistant", "tool")


class ApiError(Exception):
    """An error answered with OpenAI's body: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.retry_after = retry_after

    def body(self) -> ErrorResponse:
        return ErrorResponse(ErrorInfo(self.message, self.type, self.param, self.code))


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


# ---- requests ----------------------------------------------------------------------------


class ContentPart(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class ResponseFormat(msgspec.Struct, kw_only=True):
    type: str = "text"


class _GenerationRequest(msgspec.Struct, kw_only=True):
    """Fields shared by /v1/chat/completions and /v1/completions (vLLM's extras included)."""

    model: str | None = None
    max_tokens: int | None = None
    n: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = None
    priority: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    user: str | None = None
    best_of: int | None = None
    logit_bias: dict[str, float] | None = None
    # Reasoning models (needs a reasoning parser): at most this many tokens of thinking.
    thinking_budget: int | None = None
    thinking_token_budget: int | None = None  # alias of thinking_budget


class ChatCompletionRequest(_GenerationRequest, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: ResponseFormat | None = None


class CompletionRequest(_GenerationRequest, kw_only=True):
    prompt: str | list[str | int | list[int]]
    logprobs: int | None = None
    echo: bool | None = False
    suffix: str | None = None


class TokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    tokens: list[int]
    model: str | None = None


_PATH = re.compile(r" - at `\$\.?(.*)`$")
_MISSING = re.compile(r"missing required field `([^`]+)`")


def decode_request(body: bytes, request_type: type):
    """Decode and type-check a JSON body; any failure is a 400 naming the field."""
    try:
        return msgspec.json.decode(body, type=request_type)
    except msgspec.ValidationError as exc:
        message = str(exc)
        path = _PATH.search(message)
        missing = _MISSING.search(message)
        parts = [p for p in (path.group(1) if path else "", missing.group(1) if missing else "") if p]
        param = ".".join(parts) if parts else None
        raise bad_request(message, param=param) from None
    except msgspec.DecodeError as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    except RecursionError:
        raise bad_request("the request body is nested too deeply", code="invalid_json") from None


# ---- validation -----------------------------------------------------------------------------


def check_unsupported(request: _GenerationRequest) -> None:
    if request.logit_bias:
        raise bad_request("logit_bias is not supported", param="logit_bias")
    if request.best_of is not None and request.best_of != (request.n or 1):
        raise bad_request("best_of other than n is not supported", param="best_of")
    if isinstance(request, ChatCompletionRequest):
        if request.tools:
            raise bad_request("tool calling is not supported", param="tools")
        if request.response_format is not None and request.response_format.type != "text":
            raise bad_request("only response_format type 'text' is supported", param="response_format")
    if isinstance(request, CompletionRequest):
        if request.echo:
            raise bad_request("echo is not supported", param="echo")
        if request.suffix:
            raise bad_request("suffix is not supported", param="suffix")


def sampling_params(request: _GenerationRequest, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    """The request's sampling fields, checked (ranges, limits); a ValueError becomes a 400."""
    stop = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
    if len(stop) > MAX_STOP_STRINGS:
        raise bad_request(f"at most {MAX_STOP_STRINGS} stop strings are allowed", param="stop")
    if any(len(s) > MAX_STOP_STRING_CHARS for s in stop):
        raise bad_request(f"a stop string may have at most {MAX_STOP_STRING_CHARS} characters", param="stop")
    if len(request.stop_token_ids or ()) > MAX_STOP_TOKEN_IDS:
        raise bad_request(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids are allowed", param="stop_token_ids")
    for name in ("seed", "top_k", "min_tokens", "priority", "thinking_budget", "thinking_token_budget"):
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
            skip_special_tokens=request.skip_special_tokens,
            include_stop_str_in_output=request.include_stop_str_in_output,
            thinking_budget=request.thinking_budget,
            thinking_token_budget=request.thinking_token_budget,
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


def template_messages(messages: list[ChatMessage]) -> list[dict]:
    """Messages as the chat template wants them; text parts only, roles the API defines only
    (a template copies the role into the prompt as it is)."""
    if not messages:
        raise bad_request("messages must not be empty", param="messages")
    result = []
    for index, message in enumerate(messages):
        if message.role not in ROLES:
            raise bad_request(f"unknown role {message.role!r}: a message's role is one of {', '.join(ROLES)}",
                              param=f"messages[{index}].role")
        content = message.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.type != "text" or part.text is None:
                    raise bad_request(f"only text content parts are supported, got {part.type!r}",
                                      param=f"messages[{index}].content")
                texts.append(part.text)
            content = "\n".join(texts)
        entry = {"role": message.role, "content": content or ""}
        if message.name is not None:
            entry["name"] = message.name
        result.append(entry)
    return result


def completion_prompts(prompt) -> list[str | list[int]]:
    """A completions prompt is a string, a token-id list, or a list of either."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request("prompt must not be empty", param="prompt")
    if isinstance(prompt[0], int):
        try:  # msgspec checks a long id list in C, where a Python loop would hold the event loop
            return [msgspec.convert(prompt, list[int])]
        except msgspec.ValidationError:
            raise bad_request("prompt must be a string, a list of token ids, or a list of either",
                              param="prompt") from None
    kinds = set(map(type, prompt))  # one pass in C
    if kinds == {str} or kinds == {list}:
        return list(prompt)
    raise bad_request("prompt must be a string, a list of token ids, or a list of either", param="prompt")


# ---- error bodies ---------------------------------------------------------------------------


class ErrorInfo(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(msgspec.Struct):
    error: ErrorInfo
