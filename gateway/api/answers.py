"""OpenAI answer bodies: chat completions and their stream chunks, completions, usage,
logprobs, the model list and the tokenizer endpoints. Requests and errors: gateway/api/openai.py.

Structs with `omit_defaults` leave out optional fields (usage details, reasoning) that a
plain answer does not carry, as OpenAI's own answers do.
"""

from __future__ import annotations

from typing import Any

import msgspec


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int


class CompletionTokensDetails(msgspec.Struct):
    reasoning_tokens: int


class Usage(msgspec.Struct, omit_defaults=True):
    """`completion_tokens_details` only from a server with a reasoning parser."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    completion_tokens_details: CompletionTokensDetails | None = None


class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct):
    content: list[ChatTokenLogprob]


class CompletionLogprobs(msgspec.Struct):
    text_offset: list[int]
    token_logprobs: list[float]
    tokens: list[str]
    top_logprobs: list[dict[str, float]]


class FunctionCall(msgspec.Struct):
    name: str
    arguments: str  # a JSON object as text


class ToolCallAnswer(msgspec.Struct):
    """One of message.tool_calls."""

    id: str
    function: FunctionCall
    type: str = "function"


class FunctionDelta(msgspec.Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class ToolCallChunk(msgspec.Struct, omit_defaults=True):
    """One of delta.tool_calls: the call's first carries its id, type and name; the arguments
    fragments of one index join to its arguments."""

    index: int
    id: str | None = None
    type: str | None = None
    function: FunctionDelta | None = None


class AssistantMessage(msgspec.Struct):
    """With a reasoning parser, the thinking (markers excluded) is `reasoning_content`, and
    `reasoning` too (the newer name); both are left out without one. `tool_calls` only where
    the request let the model call its tools (content then None when there is no text)."""

    role: str
    content: str | None
    reasoning_content: str | None | msgspec.UnsetType = msgspec.UNSET
    reasoning: str | None | msgspec.UnsetType = msgspec.UNSET
    tool_calls: list[ToolCallAnswer] | msgspec.UnsetType = msgspec.UNSET


class PromptLogprob(msgspec.Struct):
    """One entry of vLLM's `prompt_logprobs`, keyed by token id."""

    logprob: float
    rank: int
    decoded_token: str


PromptLogprobs = list[dict[str, PromptLogprob] | None]


class ChatChoice(msgspec.Struct):
    """`token_ids` only when asked for (`return_token_ids`) or when the server has no tokenizer."""

    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None = None
    token_ids: list[int] | msgspec.UnsetType = msgspec.UNSET


class ChatCompletion(msgspec.Struct, kw_only=True):
    """`prompt_token_ids`, `prompt_logprobs` and `notice` (why the text is empty, on a server
    without a tokenizer) only when they apply."""

    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: str = "chat.completion"
    prompt_token_ids: list[int] | msgspec.UnsetType = msgspec.UNSET
    prompt_logprobs: PromptLogprobs | msgspec.UnsetType = msgspec.UNSET
    notice: str | msgspec.UnsetType = msgspec.UNSET
    # A prefill server's answer (vLLM's): where the decode server pulls the prompt's KV from.
    kv_transfer_params: dict[str, Any] | msgspec.UnsetType = msgspec.UNSET


class ChatDelta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCallChunk] | None = None


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | msgspec.UnsetType = msgspec.UNSET


class ChatCompletionChunk(msgspec.Struct, kw_only=True, omit_defaults=True):
    """`usage` appears only when the client asked for it (stream_options)."""

    id: str
    object: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = None  # the first chunk, when asked for


class CompletionChoice(msgspec.Struct):
    """vLLM's extras only when they apply: the token ids (asked for, or no tokenizer) and the
    prompt's logprobs."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_token_ids: list[int] | msgspec.UnsetType = msgspec.UNSET
    token_ids: list[int] | msgspec.UnsetType = msgspec.UNSET
    prompt_logprobs: PromptLogprobs | msgspec.UnsetType = msgspec.UNSET


class Completion(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A whole completion, or one streamed chunk of it (then `usage` only when asked for)."""

    id: str
    object: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    notice: str | None = None  # why the text is empty, on a server without a tokenizer
    # A prefill server's answer (vLLM's): where the decode server pulls the prompt's KV from.
    kv_transfer_params: dict[str, Any] | None = None


class ModelPermission(msgspec.Struct):
    """vLLM's fixed permission entry of a model card (what OpenAI once reported)."""

    id: str
    created: int
    object: str = "model_permission"
    allow_create_engine: bool = False
    allow_sampling: bool = True
    allow_logprobs: bool = True
    allow_search_indices: bool = False
    allow_view: bool = True
    allow_fine_tuning: bool = False
    organization: str = "*"
    group: str | None = None
    is_blocking: bool = False


class ModelCard(msgspec.Struct, kw_only=True):
    """vLLM's model card: `root` is the model the name serves, `parent` a base model (none here)."""

    id: str
    created: int
    root: str
    max_model_len: int
    permission: list[ModelPermission]
    object: str = "model"
    owned_by: str = "spillway"
    parent: str | None = None


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"


class TokenizeResponse(msgspec.Struct):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(msgspec.Struct):
    prompt: str
