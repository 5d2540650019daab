"""Tool calling through the HTTP server with the openai client: a fake worker replays a Hermes-style
answer that calls two tools, parsed by `--tool-call-parser hermes` into `tool_calls` (whole, and
streamed as OpenAI's delta.tool_calls, joined to the same calls); the real SmolLM2 held by the
grammar to tool_choice "required" and to a named function, whose calls always parse and whose
arguments follow the tools' schemas; and the 400s."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from fake_worker import FakeWorkerProcess
from server_helpers import MODEL, real_server, server_in_thread
from spillway.gateway.http.app import ServerSettings, build_app
from spillway.protocol.config import WorkerConfig
from spillway.protocol.local import model_files

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 20}},
                                       "required": ["zone"]}}}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather in Paris, and the time in Tokyo?"}]
SCRIPTED = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
            '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "Asia/Tokyo"}}\n</tool_call>')
CALLS = [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"zone": "Asia/Tokyo"})]
SCRIPT_TOKENS: list[int] = []


@pytest.fixture(scope="module")
def fake_client():
    files = model_files.resolve_model(None)
    script = model_files.load_tokenizer(files)(SCRIPTED, add_special_tokens=False)["input_ids"]
    SCRIPT_TOKENS.append(len(script))  # the fake worker replays it, then ends for max_tokens
    config = WorkerConfig(model=str(files.path), served_model_name=MODEL, max_model_len=512)
    app = build_app(ServerSettings(worker=config, served_model_names=[MODEL], tool_call_parser="hermes"),
                    lambda: FakeWorkerProcess(config, script, step_s=0.001))
    with server_in_thread(app) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_auto_tool_calls_are_parsed_whole(fake_client):
    reply = fake_client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=SCRIPT_TOKENS[0])
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me look.\n"
    calls = choice.message.tool_calls
    assert [(call.function.name, json.loads(call.function.arguments)) for call in calls] == CALLS
    assert all(call.type == "function" and call.id.startswith("call_") for call in calls)
    assert len({call.id for call in calls}) == 2


def test_auto_tool_calls_stream_as_deltas_that_join_to_the_whole(fake_client):
    content, names, arguments, ids, finish = [], {}, {}, {}, []
    for chunk in fake_client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                                     max_tokens=SCRIPT_TOKENS[0], stream=True):
        for choice in chunk.choices:
            content.append(choice.delta.content or "")
            for call in choice.delta.tool_calls or []:
                if call.id is not None:
                    ids[call.index], names[call.index] = call.id, call.function.name
                arguments[call.index] = arguments.get(call.index, "") + (call.function.arguments or "")
            finish.append(choice.finish_reason)
    assert "".join(content) == "Let me look.\n"
    assert [(names[i], json.loads(arguments[i])) for i in sorted(names)] == CALLS
    assert finish[-1] == "tool_calls" and len(set(ids.values())) == 2


def test_tool_choice_none_leaves_the_text_alone(fake_client):
    reply = fake_client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none",
                                                max_tokens=SCRIPT_TOKENS[0])
    assert reply.choices[0].message.content == SCRIPTED and not reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason == "length"


@pytest.fixture(scope="module")
def client():
    with real_server("--max-model-len", "1024") as server:  # no tool-call parser: "auto" is refused
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def schema_of(name: str) -> dict:
    return next(tool["function"]["parameters"] for tool in TOOLS if tool["function"]["name"] == name)


@pytest.mark.slow
def test_required_tool_calls_always_parse(client):
    for stream in (False, True):
        request = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=300,
                       temperature=0.7, seed=5, frequency_penalty=0.5)
        if not stream:
            choice = client.chat.completions.create(**request).choices[0]
            calls = [(call.function.name, call.function.arguments) for call in choice.message.tool_calls]
            finish = choice.finish_reason
            assert choice.message.content is None
        else:
            parts: dict[int, list] = {}
            for chunk in client.chat.completions.create(**request, stream=True):
                for choice in chunk.choices:
                    for call in choice.delta.tool_calls or []:
                        parts.setdefault(call.index, [call.function.name, ""])[1] += call.function.arguments or ""
                    finish = choice.finish_reason or None
            calls = [tuple(parts[index]) for index in sorted(parts)]
        assert finish == "tool_calls" and calls
        for name, arguments in calls:
            jsonschema.validate(json.loads(arguments), schema_of(name))


@pytest.mark.slow
def test_a_named_function_is_called_with_arguments_in_its_schema(client):
    reply = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=200, temperature=0.7, seed=5, frequency_penalty=0.5)
    choice = reply.choices[0]
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_time" and choice.finish_reason == "stop"
    jsonschema.validate(json.loads(call.function.arguments), schema_of("get_time"))


@pytest.mark.slow
@pytest.mark.parametrize("fields, problem", [
    ({"tools": TOOLS}, '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser'),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "'nope'"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "cannot also follow"),
    ({"tool_choice": "required"}, "tool_choice needs tools"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}], "tool_choice": "required"},
     "tools[0].function.name"),
])
def test_bad_tool_requests_are_400s(client, fields, problem):
    with pytest.raises(openai.BadRequestError, match=re_escape(problem)):
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5, **fields)


def re_escape(text: str) -> str:
    import re

    return re.escape(text)
