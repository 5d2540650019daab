"""litellm's `completion` against the server, as its users point it at an OpenAI-compatible one
(`model="openai/NAME"`, `api_base`): Hermes-style tool calls replayed by a fake worker come back
as litellm's tool calls, whole and streamed (rebuilt by `stream_chunk_builder`); on the real
SmolLM2, a json_schema response_format gives an answer that validates and a required tool_choice
calls that parse."""

from __future__ import annotations

import json
import os

import jsonschema
import pytest

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # its model list from the package, not the network
import litellm  # noqa: E402

from server_helpers import MODEL, real_server, server_in_thread
from spillway.gateway.http.app import ServerSettings, build_app
from spillway.protocol.config import WorkerConfig
from spillway.protocol.local import model_files
from fake_worker import FakeWorkerProcess
from test_server_tools import ASK, CALLS, SCRIPTED, TOOLS, schema_of


RECORD = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                           "population": {"type": "integer", "minimum": 0},
                                           "tags": {"type": "array", "items": {"enum": ["old", "new", "big"]},
                                                    "maxItems": 3}},
          "required": ["city", "population", "tags"], "additionalProperties": False}


@pytest.fixture(scope="module")
def fake_url():
    files = model_files.resolve_model(None)
    script = model_files.load_tokenizer(files)(SCRIPTED, add_special_tokens=False)["input_ids"]
    config = WorkerConfig(model=str(files.path), served_model_name=MODEL, max_model_len=512)
    app = build_app(ServerSettings(worker=config, served_model_names=[MODEL], tool_call_parser="hermes"),
                    lambda: FakeWorkerProcess(config, script, step_s=0.001))
    with server_in_thread(app) as url:
        yield url + "/v1", len(script)


def ask(url: str, **fields):
    return litellm.completion(model="openai/" + MODEL, api_base=url, api_key="unused", messages=ASK, **fields)


def test_auto_tool_calls_come_back_whole_and_streamed(fake_url):
    url, length = fake_url
    whole = ask(url, tools=TOOLS, max_tokens=length)
    chunks = list(ask(url, tools=TOOLS, max_tokens=length, stream=True))
    rebuilt = litellm.stream_chunk_builder(chunks, messages=ASK)
    for reply in (whole, rebuilt):
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert [(call.function.name, json.loads(call.function.arguments))
                for call in choice.message.tool_calls] == CALLS


@pytest.fixture(scope="module")
def real_url():
    with real_server("--max-model-len", "1024") as server:
        yield server.url + "/v1"


@pytest.mark.slow
def test_a_json_schema_answer_validates_and_required_tool_calls_parse(real_url):
    reply = ask(real_url, max_tokens=300, temperature=0.7, seed=3, frequency_penalty=0.5,
                response_format={"type": "json_schema", "json_schema": {"name": "record", "schema": RECORD,
                                                                        "strict": True}})
    jsonschema.validate(json.loads(reply.choices[0].message.content), RECORD)
    reply = ask(real_url, tools=TOOLS, tool_choice="required", max_tokens=300, temperature=0.7, seed=5,
                frequency_penalty=0.5)
    calls = reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason == "tool_calls" and calls
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), schema_of(call.function.name))
