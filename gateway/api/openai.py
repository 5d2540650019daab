"""OpenAI request bodies and error bodies (answers: gateway/api/answers.py; checks of the
values: gateway/api/request_checks.py).

Requests are decoded by msgspec straight into typed Structs, so a wrong type is a 400 that
names the field. Every field vLLM accepts is declared: the checks honour it or refuse it with a
400 naming it (tools, logit_bias, structured outputs, ...), never drop it. Other unknown fields
are ignored, as clients send many optional ones.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec


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


class FunctionCall(msgspec.Struct, kw_only=True):
    name: str
    arguments: str  # JSON, as OpenAI sends it


class ToolCall(msgspec.Struct, kw_only=True):
    id: str
    function: FunctionCall
    type: str = "function"


class ChatMessage(msgspec.Struct, kw_only=True):
    """A message of the history; tool calls and tool results are rendered by the chat template."""

    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool message's answer to one


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class ResponseFormat(msgspec.Struct, kw_only=True):
    type: str = "text"
    json_schema: dict[str, Any] | None = None
    structural_tag: dict[str, Any] | None = None  # vLLM's type "structural_tag"


class _GenerationRequest(msgspec.Struct, kw_only=True):
    """Fields shared by /v1/chat/completions and /v1/completions: OpenAI's and every extra of
    vLLM's, so none is dropped unseen. Those Spillway has no feature for are refused by
    gateway/api/request_checks.py when set."""

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
    request_id: str | None = None  # the answer's id is "<prefix>-<request_id>"
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    truncate_prompt_tokens: int | None = None
    prompt_logprobs: int | None = None
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = None
    user: str | None = None
    best_of: int | None = None
    use_beam_search: bool = False
    length_penalty: float = 1.0
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    logits_processors: list[Any] | None = None
    response_format: ResponseFormat | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structural_tag: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    structured_outputs: dict[str, Any] | None = None
    kv_transfer_params: dict[str, Any] | None = None
    vllm_xargs: dict[str, Any] | None = None
    # Reasoning models (needs a reasoning parser): at most this many tokens of thinking.
    thinking_budget: int | None = None
    thinking_token_budget: int | None = None  # alias of thinking_budget


class ChatCompletionRequest(_GenerationRequest, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False  # the chat template places its special tokens itself
    documents: list[dict[str, str]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None  # handed to the chat template, as vLLM does
    include_reasoning: bool = True
    mm_processor_kwargs: dict[str, Any] | None = None
    media_io_kwargs: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = True


class CompletionRequest(_GenerationRequest, kw_only=True):
    prompt: str | list[str | int | list[int]] | None = None
    prompt_embeds: str | list[str] | None = None
    logprobs: int | None = None
    echo: bool | None = False
    suffix: str | None = None
    add_special_tokens: bool = True


class TokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template: str | None = None
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


# ---- error bodies ---------------------------------------------------------------------------


class ErrorInfo(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(msgspec.Struct):
    error: ErrorInfo
