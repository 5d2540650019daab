"""Every request field vLLM accepts on /v1/chat/completions and /v1/completions, sent to the
gateway (fake worker): each is honoured, with an effect the test sees (in the answer, or in
the Generate the worker receives) against the same request without the field, or refused with
a 400 that names it. None is dropped. Two fields vLLM itself gives no effect (`user`,
`parallel_tool_calls` without tools) are shown declared: a wrong type is a 400 naming them.

The field lists are vLLM's ChatCompletionRequest and CompletionRequest; a field missing from
the table fails `test_every_vllm_field_has_a_row`; test_request_fields_honoured.py sends its rows.
"""

from __future__ import annotations

import json

from dataclasses import dataclass
from typing import Callable

import pytest

from server_helpers import MODEL, SHORT_MODEL
from spillway.gateway.api import openai as api
from spillway.protocol.hashing import unpack_token_ids
from spillway.protocol.messages import Generate

OUTPUT = "Hello there friend"
BOS = 0  # <|endoftext|>: the test tokenizer adds it as a BOS (SmolLM2's own adds nothing)
CHAT = "/v1/chat/completions"
COMPLETION = "/v1/completions"
SHARED_FIELDS = (
    "model", "max_tokens", "n", "temperature", "top_p", "seed", "stop", "stream", "stream_options", "user",
    "presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "response_format", "best_of",
    "use_beam_search", "top_k", "min_p", "repetition_penalty", "length_penalty", "stop_token_ids",
    "include_stop_str_in_output", "ignore_eos", "min_tokens", "skip_special_tokens",
    "spaces_between_special_tokens", "truncate_prompt_tokens", "prompt_logprobs", "allowed_token_ids",
    "bad_words", "echo", "add_special_tokens", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
    "structural_tag", "guided_decoding_backend", "guided_whitespace_pattern", "structured_outputs", "priority",
    "request_id", "logits_processors", "return_tokens_as_token_ids", "return_token_ids", "cache_salt",
    "kv_transfer_params", "vllm_xargs")
VLLM_FIELDS = {
    CHAT: SHARED_FIELDS + (
        "messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls",
        "reasoning_effort", "include_reasoning", "add_generation_prompt", "continue_final_message", "documents",
        "chat_template", "chat_template_kwargs", "mm_processor_kwargs", "media_io_kwargs"),
    COMPLETION: SHARED_FIELDS + ("prompt", "suffix", "prompt_embeds"),
}
SCRIPT: list[int] = []  # the fake worker's output: OUTPUT's tokens, then <|im_end|>
TEMPLATE = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"


@dataclass
class Sent:
    """One request's answer and the Generate messages the worker received for it."""

    status: int
    answer: dict | str
    generates: list[Generate]

    @property
    def generate(self) -> Generate:
        return self.generates[0]

    @property
    def choice(self) -> dict:
        return self.answer["choices"][0]

    @property
    def tokens(self) -> list[int]:
        """The output tokens the fake worker replays."""
        return SCRIPT[:self.answer["usage"]["completion_tokens"]]

    def text(self) -> str:
        return self.choice["message"]["content"] if "message" in self.choice else self.choice["text"]


def tokens(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


# ---- what "honoured" looks like, per field ----------------------------------------------------


def wire(name: str, value) -> Callable:
    """The value reached the worker's sampling parameters."""
    def check(sent: Sent, base: Sent, tokenizer) -> None:
        assert getattr(sent.generate.params, name) == value
        assert getattr(base.generate.params, name) != value
    return check


def prompt_ends_with(text: str, *, special: bool = False) -> Callable:
    def check(sent: Sent, base: Sent, tokenizer) -> None:
        ids = tokens(tokenizer, text)
        assert unpack_token_ids(sent.generate.prompt_token_ids)[-len(ids):] == ids
        assert unpack_token_ids(sent.generate.prompt_token_ids) != unpack_token_ids(base.generate.prompt_token_ids)
    return check


def answer(predicate: Callable[[Sent], bool]) -> Callable:
    def check(sent: Sent, base: Sent, tokenizer) -> None:
        assert predicate(sent), sent.answer
        assert not predicate(base), base.answer
    return check


def cache_salted(sent: Sent, base: Sent, tokenizer) -> None:
    assert sent.generate.cache_salt == "salt"
    assert sent.generate.block_hashes[0] != base.generate.block_hashes[0]


def tool_history(sent: Sent, base: Sent, tokenizer) -> None:
    """Tool calls and tool results reach the template (which renders them here)."""
    prompt = tokenizer.decode(unpack_token_ids(sent.generate.prompt_token_ids))
    assert "call:get_weather{'city': 'Paris'}" in prompt and "[tool#c1]sunny" in prompt, prompt


def served_as_default(sent: Sent, base: Sent, tokenizer) -> None:
    """The short name is accepted; the answer names the model by its hub id."""
    assert SHORT_MODEL != MODEL and sent.answer["model"] == MODEL == base.answer["model"]


def same_text(sent: Sent, base: Sent, tokenizer) -> None:
    """Accepted, and the answer is what it is without the field (its neutral value)."""
    assert [c.get("message", c).get("content", c.get("text")) for c in sent.answer["choices"]] == \
        [c.get("message", c).get("content", c.get("text")) for c in base.answer["choices"]]


def prompt_as_without(sent: Sent, base: Sent, tokenizer) -> None:
    assert unpack_token_ids(sent.generate.prompt_token_ids) == unpack_token_ids(base.generate.prompt_token_ids)


def token_ids_returned(sent: Sent, base: Sent, tokenizer) -> None:
    prompt_ids = sent.answer.get("prompt_token_ids", sent.choice.get("prompt_token_ids"))
    assert prompt_ids == unpack_token_ids(sent.generate.prompt_token_ids)
    assert sent.choice["token_ids"] == sent.tokens
    assert "token_ids" not in base.choice and "prompt_token_ids" not in base.answer | base.choice


def prompt_logprobs_returned(sent: Sent, base: Sent, tokenizer) -> None:
    """vLLM's shape: None for the first prompt token, then token id -> {logprob, rank, decoded_token}."""
    entries = sent.answer.get("prompt_logprobs", sent.choice.get("prompt_logprobs"))
    prompt = unpack_token_ids(sent.generate.prompt_token_ids)
    assert entries[0] is None and len(entries) == len(prompt)
    for token_id, entry in zip(prompt[1:], entries[1:]):
        assert entry[str(token_id)] == {"logprob": -0.25, "rank": 1, "decoded_token": tokenizer.decode([token_id])}
        assert len(entry) >= 2  # with the top alternatives
    assert "prompt_logprobs" not in base.answer | base.choice


REFUSED = "refused"
TOOL_TEMPLATE = ("{% for m in messages %}[{{ m.role }}{% if m.tool_call_id %}#{{ m.tool_call_id }}{% endif %}]"
                 "{{ m.content }}{% for c in m.tool_calls or [] %}call:{{ c.function.name }}{{ c.function.arguments }}"
                 "{% endfor %}{% endfor %}")
TOOL_MESSAGES = [{"role": "user", "content": "Weather?"},
                 {"role": "assistant", "content": None, "tool_calls": [
                     {"id": "c1", "type": "function",
                      "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                 {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
# Each way of asking for a constraint, and the wire's StructuredOutput (kind, spec) it becomes.
STRUCTURED = {"guided_json": ({"type": "object"}, ("json", '{"type": "object"}')),
              "guided_regex": ("a+", ("regex", "a+")),
              "guided_choice": (["a", "b"], ("choice", '["a", "b"]')),
              "guided_grammar": ('root ::= "a"', ("grammar", 'root ::= "a"')),
              "structural_tag": ("{}", ("structural_tag", "{}")),
              "structured_outputs": ({"regex": "a+"}, ("regex", "a+"))}


def constrained(kind: str, spec: str) -> Callable:
    """The constraint reached the worker's sampling parameters."""
    def check(sent: Sent, base: Sent, tokenizer) -> None:
        structured = sent.generate.params.structured
        assert (structured.kind.value, structured.spec) == (kind, spec)
        assert base.generate.params.structured is None
    return check


def calls_constrained(kind: str, spec: str) -> Callable:
    """tool_choice "required" or a named function reached the worker as its grammar; without
    it, the tools ask for "auto", which this server (no --tool-call-parser) refuses."""
    def check(sent: Sent, base: Sent, tokenizer) -> None:
        structured = sent.generate.params.structured
        assert (structured.kind.value, json.loads(structured.spec)) == (kind, json.loads(spec))
        assert base.status == 400 and base.answer["error"]["param"] == "tools"
    return check


# (field, the fields sent, what is expected); a field may have several rows.
SHARED_ROWS = [
    ("model", {"model": SHORT_MODEL}, served_as_default),
    ("max_tokens", {"max_tokens": 2}, answer(lambda s: s.answer["usage"]["completion_tokens"] == 2)),
    ("n", {"n": 2}, answer(lambda s: len(s.answer["choices"]) == 2)),
    ("temperature", {"temperature": 0.25}, wire("temperature", 0.25)),
    ("top_p", {"top_p": 0.5}, wire("top_p", 0.5)),
    ("seed", {"seed": 7}, wire("seed", 7)),
    ("stop", {"stop": " friend"}, answer(lambda s: s.text() == "Hello there")),
    ("stream", {"stream": True}, answer(lambda s: isinstance(s.answer, str) and s.answer.endswith("[DONE]\n\n"))),
    ("stream_options", {"stream": True, "stream_options": {"include_usage": True}},
     answer(lambda s: isinstance(s.answer, str) and '"usage":{"prompt_tokens"' in s.answer)),
    ("user", {"user": 5}, REFUSED),  # declared (a wrong type is named); vLLM uses it for nothing either
    ("presence_penalty", {"presence_penalty": 0.5}, wire("presence_penalty", 0.5)),
    ("frequency_penalty", {"frequency_penalty": 0.5}, wire("frequency_penalty", 0.5)),
    ("logit_bias", {"logit_bias": {"5": 1.0}}, REFUSED),
    ("response_format", {"response_format": {"type": "json_object"}}, constrained("json_object", "")),
    ("response_format", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "n", "schema": {"type": "object", "properties": {"a": {"type": "integer"}}}, "strict": True}}},
     constrained("json", '{"type": "object", "properties": {"a": {"type": "integer"}}}')),
    ("response_format", {"response_format": {"type": "json_schema", "json_schema": {"name": "n"}}}, REFUSED),
    ("response_format", {"response_format": {"type": "xml"}}, REFUSED),
    ("response_format", {"response_format": {"type": "text"}}, same_text),  # the default: plain text
    ("best_of", {"best_of": 2, "n": 2}, same_text),  # best_of = n: the n samples
    ("best_of", {"best_of": 3}, REFUSED),
    ("use_beam_search", {"use_beam_search": True}, REFUSED),
    ("top_k", {"top_k": 5}, wire("top_k", 5)),
    ("min_p", {"min_p": 0.25}, wire("min_p", 0.25)),
    ("repetition_penalty", {"repetition_penalty": 1.25}, wire("repetition_penalty", 1.25)),
    ("length_penalty", {"length_penalty": 0.5}, REFUSED),
    ("stop_token_ids", {"stop_token_ids": [9]}, wire("stop_token_ids", (9,))),
    ("include_stop_str_in_output", {"stop": " friend", "include_stop_str_in_output": True},
     answer(lambda s: s.text() == OUTPUT and s.choice["finish_reason"] == "stop")),
    ("ignore_eos", {"ignore_eos": True}, wire("ignore_eos", True)),
    ("min_tokens", {"min_tokens": 2}, wire("min_tokens", 2)),
    ("skip_special_tokens", {"skip_special_tokens": False}, answer(lambda s: s.text().endswith("<|im_end|>"))),
    ("spaces_between_special_tokens", {"spaces_between_special_tokens": False}, REFUSED),
    ("truncate_prompt_tokens", {"truncate_prompt_tokens": 2},
     answer(lambda s: s.answer["usage"]["prompt_tokens"] == 2)),
    ("prompt_logprobs", {"prompt_logprobs": 2}, prompt_logprobs_returned),
    ("prompt_logprobs", {"prompt_logprobs": 21}, REFUSED),  # past the limit
    ("prompt_logprobs", {"prompt_logprobs": 1, "stream": True}, REFUSED),  # as vLLM
    ("allowed_token_ids", {"allowed_token_ids": [1, 2]}, REFUSED),
    ("bad_words", {"bad_words": ["friend"]}, REFUSED),
    ("echo", {"echo": True}, REFUSED),
    *[(name, {name: value}, constrained(*wired)) for name, (value, wired) in STRUCTURED.items()],
    ("structured_outputs", {"structured_outputs": {"regex": "a+", "choice": ["a"]}}, REFUSED),  # two at once
    ("structured_outputs", {"structured_outputs": {"regexp": "a+"}}, REFUSED),  # an unknown field
    ("structured_outputs", {"structured_outputs": {"json": "{not json"}}, REFUSED),
    ("structured_outputs", {"structured_outputs": {"regex": "a+"}, "guided_choice": ["a"]}, REFUSED),
    ("guided_decoding_backend", {"guided_decoding_backend": "xgrammar"}, same_text),  # names a backend only
    ("guided_whitespace_pattern", {"guided_whitespace_pattern": " "}, REFUSED),
    ("priority", {"priority": 3}, answer(lambda s: s.generate.priority == 3)),
    ("request_id", {"request_id": "my-id"}, answer(lambda s: s.answer["id"].endswith("-my-id"))),
    ("logits_processors", {"logits_processors": ["my.module.Processor"]}, REFUSED),
    ("return_token_ids", {"return_token_ids": True}, token_ids_returned),
    ("kv_transfer_params", {"kv_transfer_params": {"do_remote_decode": True}}, REFUSED),
    ("vllm_xargs", {"vllm_xargs": {"key": 1}}, REFUSED),
]
CHAT_ROWS = [
    ("messages", {"messages": [{"role": "user", "content": "Hello, how are you"}]}, prompt_ends_with(
        "Hello, how are you<|im_end|>\n<|im_start|>assistant\n")),
    ("max_completion_tokens", {"max_tokens": None, "max_completion_tokens": 3},
     answer(lambda s: s.answer["usage"]["completion_tokens"] == 3)),
    ("logprobs", {"logprobs": True}, answer(lambda s: s.choice["logprobs"] is not None)),
    ("top_logprobs", {"logprobs": True, "top_logprobs": 3},
     answer(lambda s: len(s.choice["logprobs"]["content"][0]["top_logprobs"]) == 3)),
    ("tools", {"tools": TOOLS}, REFUSED),  # "auto", and this server has no --tool-call-parser
    ("tool_choice", {"tools": TOOLS, "tool_choice": "required"},
     calls_constrained("json", '{"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": [{"properties": '
                         '{"name": {"type": "string", "enum": ["get_weather"]}, "parameters": {"type": "object"}}, '
                         '"required": ["name", "parameters"]}]}}')),
    ("tool_choice", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
     calls_constrained("json", '{"type": "object"}')),
    ("tool_choice", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, REFUSED),
    ("tools", {"tools": TOOLS, "tool_choice": "none"}, prompt_as_without),  # left out, as vLLM does
    ("tool_choice", {"tool_choice": "auto"}, REFUSED),
    ("parallel_tool_calls", {"parallel_tool_calls": "yes"}, REFUSED),  # declared; no tools run without it
    ("reasoning_effort", {"chat_template": "{{ reasoning_effort }}" + TEMPLATE, "reasoning_effort": "low"},
     prompt_ends_with("low[user]Hi")),
    ("return_tokens_as_token_ids", {"return_tokens_as_token_ids": True, "logprobs": True, "top_logprobs": 1},
     answer(lambda s: s.choice["logprobs"] is not None and all(
         e["token"] == f"token_id:{t}" and e["top_logprobs"][0]["token"].startswith("token_id:")
         for e, t in zip(s.choice["logprobs"]["content"], s.choice["token_ids"] if "token_ids" in s.choice
                         else s.tokens)))),
    ("include_reasoning", {"include_reasoning": False}, REFUSED),
    ("add_generation_prompt", {"add_generation_prompt": False}, prompt_ends_with("Hi<|im_end|>\n")),
    ("continue_final_message", {"add_generation_prompt": False, "continue_final_message": True,
                                "messages": [{"role": "user", "content": "Hi"},
                                             {"role": "assistant", "content": "Once upon"}]},
     prompt_ends_with("<|im_start|>assistant\nOnce upon")),
    ("continue_final_message", {"continue_final_message": True}, REFUSED),  # with add_generation_prompt
    ("add_special_tokens", {"add_special_tokens": True}, answer(lambda s: unpack_token_ids(s.generate.prompt_token_ids)[0] == BOS)),
    ("documents", {"chat_template": "{% for d in documents or [] %}{{ d.text }}{% endfor %}" + TEMPLATE,
                   "documents": [{"title": "t", "text": "Paris is sunny"}]}, prompt_ends_with("Paris is sunny[user]Hi")),
    ("chat_template", {"chat_template": TEMPLATE}, prompt_ends_with("[user]Hi")),
    ("chat_template", {"chat_template": TOOL_TEMPLATE, "messages": TOOL_MESSAGES}, tool_history),
    ("chat_template_kwargs", {"chat_template": "{{ greeting }}" + TEMPLATE, "chat_template_kwargs": {"greeting": "Ahoy"}},
     prompt_ends_with("Ahoy[user]Hi")),
    ("cache_salt", {"cache_salt": "salt"}, cache_salted),
    ("mm_processor_kwargs", {"mm_processor_kwargs": {"num_crops": 4}}, REFUSED),
    ("media_io_kwargs", {"media_io_kwargs": {"video": {"num_frames": 4}}}, REFUSED),
]
COMPLETION_ROWS = [
    ("prompt", {"prompt": "Hi there, all"}, prompt_ends_with("Hi there, all")),
    ("logprobs", {"logprobs": 2},
     answer(lambda s: s.choice["logprobs"] is not None and len(s.choice["logprobs"]["top_logprobs"][0]) >= 2)),
    ("return_tokens_as_token_ids", {"return_tokens_as_token_ids": True, "logprobs": 1},
     answer(lambda s: s.choice["logprobs"] is not None
            and s.choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in s.tokens])),
    ("add_special_tokens", {"add_special_tokens": False}, answer(lambda s: unpack_token_ids(s.generate.prompt_token_ids)[0] != BOS)),
    ("cache_salt", {"cache_salt": "salt", "prompt": "a full block of prompt tokens " * 4}, cache_salted),
    ("suffix", {"suffix": "!"}, REFUSED),
    ("prompt_embeds", {"prompt_embeds": "AAAA"}, REFUSED),
]
ROWS = [(path, *row) for path in (CHAT, COMPLETION) for row in SHARED_ROWS] + \
       [(CHAT, *row) for row in CHAT_ROWS] + [(COMPLETION, *row) for row in COMPLETION_ROWS]


@pytest.mark.parametrize("path", [CHAT, COMPLETION])
def test_every_vllm_field_has_a_row(path):
    request_type = api.ChatCompletionRequest if path == CHAT else api.CompletionRequest
    covered = {field for p, field, _, _ in ROWS if p == path}
    assert set(VLLM_FIELDS[path]) - covered == set()
    assert set(VLLM_FIELDS[path]) - set(request_type.__struct_fields__) == set()
