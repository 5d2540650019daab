"""Structured outputs through the HTTP server with the openai client, on the real SmolLM2:
`response_format` json_schema answers that validate against 20 varied schemas (nested objects,
enums, arrays, required, numbers, $defs), whole and streamed; json_object; vLLM's
`structured_outputs` regex and choice and its older `guided_*` fields; a schema the library
refuses is a 400 naming the problem."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from server_helpers import MODEL, real_server

ASK = [{"role": "user", "content": "Fill in this record with plausible values, as JSON."}]
# A 135M model's greedy answers loop more than a sampled one's; seeded, so reruns repeat.
SAMPLED = dict(temperature=0.7, seed=11, frequency_penalty=0.5)


def obj(properties: dict, required: list[str] | None = None, **extra) -> dict:
    return {"type": "object", "properties": properties, "required": required or list(properties), **extra}


# Strings and numbers are bounded: a 135M model may repeat a word or a digit until max_tokens.
STRING, INTEGER, NUMBER, BOOLEAN = ({"type": "string", "maxLength": 24}, {"type": "integer", "maximum": 9999},
                                    {"type": "number", "maximum": 100}, {"type": "boolean"})
SCHEMAS = [
    obj({"name": STRING}),
    obj({"name": STRING, "age": INTEGER}),
    obj({"title": STRING, "year": INTEGER, "rating": NUMBER}),
    obj({"done": BOOLEAN, "task": STRING}),
    obj({"color": {"type": "string", "enum": ["red", "green", "blue"]}}),
    obj({"size": {"enum": ["S", "M", "L"]}, "count": {"type": "integer", "minimum": 1, "maximum": 9}}),
    obj({"tags": {"type": "array", "items": STRING, "minItems": 1, "maxItems": 3}}),
    obj({"scores": {"type": "array", "items": INTEGER, "maxItems": 4}}),
    obj({"owner": obj({"first": STRING, "last": STRING})}),
    obj({"address": obj({"street": STRING, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}), "name": STRING}),
    obj({"points": {"type": "array", "maxItems": 2, "items": obj({"x": INTEGER, "y": INTEGER})}}),
    obj({"id": INTEGER, "note": STRING}, ["id"]),
    obj({"a": STRING, "b": STRING, "c": STRING}, ["a", "c"]),
    obj({"kind": {"const": "cat"}, "lives": INTEGER}),
    obj({"value": {"anyOf": [INTEGER, STRING]}}),
    obj({"when": {"type": "string", "format": "date"}}),
    obj({"matrix": {"type": "array", "maxItems": 2, "items": {"type": "array", "items": INTEGER, "maxItems": 2}}}),
    obj({"user": {"$ref": "#/$defs/user"}}, **{"$defs": {"user": obj({"login": STRING, "admin": BOOLEAN})}}),
    obj({"code": {"type": "string", "minLength": 2, "maxLength": 4}}),
    obj({"settings": obj({"mode": {"enum": ["fast", "slow"]}, "level": INTEGER, "flags": {
        "type": "array", "items": BOOLEAN, "maxItems": 2}})}),
]


@pytest.fixture(scope="module")
def client():
    with real_server("--max-model-len", "1024", "--max-num-seqs", "32") as server:
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def json_schema_format(index: int, schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": f"record{index}", "schema": schema, "strict": True}}


@pytest.mark.slow
def test_twenty_schemas_are_followed_whole(client):
    from concurrent.futures import ThreadPoolExecutor

    def ask(index: int):
        return client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=300, **SAMPLED,
                                              response_format=json_schema_format(index, SCHEMAS[index]))

    with ThreadPoolExecutor(len(SCHEMAS)) as pool:  # one batch on the server
        replies = list(pool.map(ask, range(len(SCHEMAS))))
    for schema, reply in zip(SCHEMAS, replies):
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), schema, format_checker=jsonschema.FormatChecker())


@pytest.mark.slow
@pytest.mark.parametrize("index", [1, 10, 17])
def test_a_streamed_answer_joins_to_the_whole_one(client, index):
    request = dict(model=MODEL, messages=ASK, max_tokens=200, temperature=0,
                   response_format=json_schema_format(index, SCHEMAS[index]))
    whole = client.chat.completions.create(**request).choices[0].message.content
    pieces, finish = [], []
    for chunk in client.chat.completions.create(**request, stream=True):
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish.append(choice.finish_reason)
    assert "".join(pieces) == whole and finish[-1] == "stop"
    jsonschema.validate(json.loads(whole), SCHEMAS[index])


@pytest.mark.slow
def test_json_object_regex_choice_and_the_older_fields(client):
    def chat(**fields) -> str:
        return client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=60, temperature=0,
                                              **fields).choices[0].message.content

    any_object = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=400, **SAMPLED,
                                                response_format={"type": "json_object"}).choices[0]
    assert any_object.finish_reason == "stop" and isinstance(json.loads(any_object.message.content), dict)
    assert re.fullmatch(r"[A-Z]{3}-\d{2}", chat(extra_body={"structured_outputs": {"regex": r"[A-Z]{3}-\d{2}"}}))
    assert chat(extra_body={"structured_outputs": {"choice": ["alpha", "beta"]}}) in ("alpha", "beta")
    assert chat(extra_body={"guided_choice": ["up", "down"]}) in ("up", "down")
    assert re.fullmatch(r"\d+", chat(extra_body={"guided_regex": r"\d+"}))
    completion = client.completions.create(model=MODEL, prompt="The answer is", max_tokens=10, temperature=0,
                                           extra_body={"guided_json": SCHEMAS[0]})
    jsonschema.validate(json.loads(completion.choices[0].text), SCHEMAS[0])


@pytest.mark.slow
def test_a_schema_the_library_refuses_is_a_400_naming_it_streamed_or_not(client):
    with pytest.raises(openai.BadRequestError, match='Unsupported type \\\\?"objekt'):
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=10, response_format=json_schema_format(
            0, {"type": "objekt"}))
    with pytest.raises(openai.BadRequestError, match='Unsupported type \\\\?"objekt'):  # streamed: the same 400
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=10, stream=True,
                                       response_format=json_schema_format(0, {"type": "objekt"}))
    with pytest.raises(openai.BadRequestError, match="response_format"):
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=10,
                                       response_format={"type": "json_schema", "json_schema": {"name": "x"}})
