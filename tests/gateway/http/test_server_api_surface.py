"""The server's surface beyond generation, as vLLM shows it (fake worker): the model list's
cards, the default model's names, the OpenAPI document, and token-id answers from a server
whose model has no tokenizer."""

from __future__ import annotations

import json

import httpx
import pytest

from fake_worker import FakeWorkerProcess
from server_helpers import MODEL, SHORT_MODEL, server_in_thread, sse_events
from spillway.gateway.http.app import ServerSettings, build_app
from spillway.protocol.local import model_files
from spillway.protocol.config import WorkerConfig

SCRIPT = [11, 12, 13, 14]
CARD_FIELDS = {"id", "object", "created", "owned_by", "root", "parent", "max_model_len", "permission"}


def serve(model_folder: str, served_name: str, load_format: str = "auto"):
    config = WorkerConfig(model=model_folder, served_model_name=served_name, max_model_len=256,
                          load_format=load_format)
    app = build_app(ServerSettings(worker=config, served_model_names=[served_name]),
                    lambda: FakeWorkerProcess(config, SCRIPT))
    return server_in_thread(app)


@pytest.fixture(scope="module")
def url():
    files = model_files.resolve_model(None)
    assert files.name == MODEL  # the default model's hub id
    with serve(str(files.path), files.name) as base:
        yield base


@pytest.fixture(scope="module")
def bare_url():
    """A model without a tokenizer: a built-in config with dummy weights."""
    files = model_files.resolve_model("qwen3-0.6b", "dummy")
    with serve(str(files.path), "bare", "dummy") as base:
        yield base


def test_models_cards_carry_vllms_fields(url):
    body = httpx.get(url + "/v1/models").json()
    (card,) = body["data"]
    assert set(card) == CARD_FIELDS
    assert (card["id"], card["root"], card["max_model_len"], card["parent"]) == (MODEL, MODEL, 256, None)
    assert card["permission"][0]["object"] == "model_permission"


def test_the_short_name_is_still_accepted(url):
    for name in (MODEL, SHORT_MODEL):
        response = httpx.post(url + "/v1/completions", json={"model": name, "prompt": "Hi", "max_tokens": 2})
        assert response.status_code == 200 and response.json()["model"] == MODEL
    response = httpx.post(url + "/v1/completions", json={"model": "SmolLM2", "prompt": "Hi", "max_tokens": 2})
    assert response.status_code == 404


def test_openapi_document_lists_every_route_with_its_methods(url):
    document = httpx.get(url + "/openapi.json").json()
    assert document["openapi"].startswith("3.")
    paths = document["paths"]
    for path, method in [("/v1/chat/completions", "post"), ("/v1/completions", "post"), ("/v1/models", "get"),
                         ("/health", "get"), ("/tokenize", "post"), ("/detokenize", "post"),
                         ("/metrics", "get"), ("/version", "get"), ("/openapi.json", "get"), ("/ping", "post")]:
        assert method in paths[path], (path, paths.get(path))
    body = paths["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    schema = document["components"]["schemas"][body["$ref"].rsplit("/", 1)[1]]
    assert {"messages", "continue_final_message", "prompt_logprobs"} <= set(schema["properties"])
    assert schema["required"] == ["messages"]


def test_token_ids_come_back_from_a_server_without_a_tokenizer(bare_url):
    request = {"model": "bare", "prompt": [5, 6, 7], "max_tokens": 3}
    answer = httpx.post(bare_url + "/v1/completions", json=request).json()
    choice = answer["choices"][0]
    assert (choice["text"], choice["token_ids"], choice["prompt_token_ids"]) == ("", SCRIPT[:3], [5, 6, 7])
    assert "no tokenizer" in answer["notice"]

    with httpx.stream("POST", bare_url + "/v1/completions", json={**request, "stream": True}) as response:
        events = [json.loads(e) for e in sse_events(response.read())[:-1]]
    streamed = [t for e in events for c in e["choices"] for t in c.get("token_ids", [])]
    assert streamed == SCRIPT[:3]

    chat = httpx.post(bare_url + "/v1/chat/completions",
                      json={"model": "bare", "messages": [{"role": "user", "content": "Hi"}]})
    assert chat.status_code == 400 and chat.json()["error"]["code"] == "no_tokenizer"
