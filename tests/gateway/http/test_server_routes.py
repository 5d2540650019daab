"""What the gateway answers outside its routes and without its key (fake worker): paths it
does not serve and wrong methods in OpenAI's error shape; with --api-key, every route but the
health checks and /metrics closed to a request without the key."""

from __future__ import annotations

import httpx
import pytest

from server_helpers import MODEL, fake_app, server_in_thread
from spillway.protocol.local import model_files

KEY = "sekrit"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
# Every route but the open ones, with a body it takes.
CLOSED = [("POST", "/v1/chat/completions", CHAT), ("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 1}),
          ("GET", "/v1/models", None), ("POST", "/invocations", CHAT), ("POST", "/tokenize", {"prompt": "Hi"}),
          ("POST", "/detokenize", {"tokens": [1]}), ("GET", "/version", None), ("GET", "/openapi.json", None),
          ("POST", "/v1/responses", {"input": "Hi"}), ("GET", "/nowhere", None)]
OPEN = [("GET", "/health"), ("GET", "/ping"), ("POST", "/ping"), ("GET", "/metrics")]


@pytest.fixture(scope="module")
def script(files) -> list[int]:
    return model_files.load_tokenizer(files)("Hello", add_special_tokens=False)["input_ids"]


def test_unknown_routes_and_wrong_methods_answer_in_openai_shape(files, script):
    app, _ = fake_app(files, script)
    with server_in_thread(app) as url:
        for path in ("/v1/responses", "/v1/embeddings", "/v1/audio/speech"):
            answer = httpx.post(url + path, json={"model": MODEL, "input": "Hi"})
            assert answer.status_code == 404, path
            assert answer.json() == {"error": {"message": f"{path} is not served by this server",
                                               "type": "not_found_error", "param": None, "code": "unknown_route"}}
        wrong = httpx.get(url + "/v1/chat/completions")
        assert wrong.status_code == 405 and wrong.headers["allow"] == "POST"
        assert wrong.json() == {"error": {"message": "GET is not allowed on /v1/chat/completions: it takes POST",
                                          "type": "invalid_request_error", "param": None,
                                          "code": "method_not_allowed"}}


def test_api_key_closes_every_route_but_health_and_metrics(files, script):
    app, _ = fake_app(files, script, api_key=KEY)
    with server_in_thread(app) as url:
        for method, path, body in CLOSED:
            for headers in ({}, {"Authorization": "Bearer wrong"}):
                answer = httpx.request(method, url + path, json=body, headers=headers)
                assert answer.status_code == 401, (path, answer.text)
                assert answer.json()["error"]["code"] == "invalid_api_key", path
        for method, path in OPEN:
            assert httpx.request(method, url + path).status_code == 200, path
        keyed = {"Authorization": f"Bearer {KEY}"}
        for method, path, body in CLOSED:
            expected = 404 if path in ("/v1/responses", "/nowhere") else 200
            assert httpx.request(method, url + path, json=body, headers=keyed).status_code == expected, path
