"""A chat request's conversation as the chat template wants it, and how to render it
(generation prompt or the last assistant message continued, documents, template variables)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from spillway.gateway.api.openai import ChatCompletionRequest, ChatMessage, TokenizeRequest, bad_request

ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass(frozen=True, slots=True)
class ChatRender:
    """How a conversation becomes a prompt (PromptTokenizer.chat_prompt's options)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False  # no new turn: the last assistant message goes on
    chat_template: str | None = None  # the request's own, over the server's
    documents: list[dict[str, str]] | None = None
    chat_template_kwargs: dict = field(default_factory=dict)
    add_special_tokens: bool = False  # the template places its special tokens itself

    def kwargs(self) -> dict:
        return dict(add_generation_prompt=self.add_generation_prompt,
                    continue_final_message=self.continue_final_message, chat_template=self.chat_template,
                    documents=self.documents, chat_template_kwargs=self.chat_template_kwargs,
                    add_special_tokens=self.add_special_tokens)


def chat_render(request: ChatCompletionRequest) -> ChatRender:
    """The request's rendering options, checked as vLLM checks them."""
    if request.continue_final_message and request.add_generation_prompt:
        raise bad_request("continue_final_message and add_generation_prompt cannot both be true: "
                          "send add_generation_prompt: false to continue the last message",
                          param="continue_final_message")
    template, kwargs = request_template(request.chat_template, request.chat_template_kwargs)
    if request.reasoning_effort is not None:
        kwargs["reasoning_effort"] = request.reasoning_effort
    return ChatRender(request.add_generation_prompt, request.continue_final_message, template,
                      request.documents, kwargs, request.add_special_tokens)


def tokenize_render(request: TokenizeRequest) -> ChatRender:
    template, kwargs = request_template(request.chat_template, request.chat_template_kwargs)
    return ChatRender(request.add_generation_prompt, chat_template=template, chat_template_kwargs=kwargs)


def request_template(chat_template: str | None, chat_template_kwargs: dict | None) -> tuple[str | None, dict]:
    """The request's own template and the template's variables. A template may come as
    `chat_template` or as `chat_template_kwargs.chat_template` (as vLLM takes it); either is the
    request's, rendered only where the server trusts requests' templates (JobBuilder.encode_chat)."""
    kwargs = dict(chat_template_kwargs or {})
    nested = kwargs.pop("chat_template", None)
    if nested is not None and not isinstance(nested, str):
        raise bad_request("chat_template_kwargs.chat_template must be a string", param="chat_template_kwargs")
    if nested is not None and chat_template is not None and nested != chat_template:
        raise bad_request("two chat templates: give chat_template or chat_template_kwargs.chat_template, not both",
                          param="chat_template")
    return chat_template if chat_template is not None else nested, kwargs


def template_messages(messages: list[ChatMessage]) -> list[dict]:
    """Messages as the chat template wants them: text parts joined; an assistant's tool calls
    with their arguments parsed (templates render them as objects), a tool message's call id."""
    if not messages:
        raise bad_request("messages must not be empty", param="messages")
    return [_template_message(index, message) for index, message in enumerate(messages)]


def _template_message(index: int, message: ChatMessage) -> dict:
    if message.role not in ROLES:  # a template copies the role into the prompt as it is
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
    entry: dict = {"role": message.role, "content": content or ""}
    if message.name is not None:
        entry["name"] = message.name
    if message.tool_call_id is not None:
        entry["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        entry["tool_calls"] = [{"id": call.id, "type": call.type,
                                "function": {"name": call.function.name,
                                             "arguments": _arguments(index, call.function.arguments)}}
                               for call in message.tool_calls]
    return entry


def _arguments(index: int, arguments: str) -> dict:
    try:
        parsed = json.loads(arguments)
    except json.JSONDecodeError as exc:
        raise bad_request(f"a tool call's arguments are not valid JSON: {exc}",
                          param=f"messages[{index}].tool_calls") from None
    if not isinstance(parsed, dict):
        raise bad_request("a tool call's arguments must be a JSON object", param=f"messages[{index}].tool_calls")
    return parsed
