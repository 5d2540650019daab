"""Reasoning models through the HTTP server: reasoning_content beside content, whole and streamed,
thinking budgets enforced by the worker, usage's reasoning_tokens, and the 400s.

The real server runs SmolLM2 with a chat template that opens <think> at the start of the reply
(the model never closes it by itself, so a budget decides exactly how much it thinks). A fake
worker replays a fixed answer with multi-byte characters around multi-token markers.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from fake_worker import FakeWorkerProcess
from server_helpers import MODEL, real_server, server_in_thread, sse_events
from spillway.gateway.http.app import ServerSettings, build_app
from spillway.protocol.config import WorkerConfig
from spillway.protocol.local import model_files

QUESTION = [{"role": "user", "content": "Why is the sky blue? Explain step by step."}]
GREEDY = dict(model=MODEL, messages=QUESTION, max_tokens=40, temperature=0)
SCRIPTED = "<think>\nThink 思考 😀 about it.</think>\n\nThe answer 世界 is here. Done 👍🏽."


def reasoning_of(message_or_delta) -> str | None:
    extra = message_or_delta.model_extra or {}
    return extra.get("reasoning_content", getattr(message_or_delta, "reasoning_content", None))


def assert_clean(text: str | None) -> None:
    assert text is None or ("<think>" not in text and "</think>" not in text and "\ufffd" not in text), text


# ---- the real model -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def template_file(tmp_path_factory):
    tok = model_files.load_tokenizer(model_files.resolve_model(None))
    # The model's own template, opening thinking at the start of the reply; with
    # enable_thinking false it writes an empty, closed thinking block instead.
    template = tok.chat_template + (
        "{% if add_generation_prompt %}"
        "{% if enable_thinking is defined and not enable_thinking %}{{ '<think>\n\n</think>\n\n' }}"
        "{% else %}{{ '<think>\n' }}{% endif %}{% endif %}")
    path = tmp_path_factory.mktemp("reasoning") / "template.jinja"
    path.write_text(template)
    return path


@pytest.fixture(scope="module")
def server(template_file):
    with real_server("--enable-reasoning", "--chat-template", str(template_file), "--max-model-len", "1024") as s:
        yield s


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("budget", [0, 1, 7])
def test_budget_caps_thinking_exactly(client, budget):
    reply = client.chat.completions.create(**GREEDY, extra_body={"thinking_budget": budget})
    message = reply.choices[0].message
    assert reply.usage.completion_tokens_details.reasoning_tokens == budget
    assert reply.usage.completion_tokens == 40  # max_tokens bounds thinking and answer together
    reasoning = reasoning_of(message)
    assert message.model_extra.get("reasoning") == reasoning
    if budget == 0:
        assert not reasoning
    else:
        assert reasoning  # budget 1 may think just a newline
    assert message.content and message.content.strip()
    assert_clean(reasoning)
    assert_clean(message.content)


@pytest.mark.slow
def test_stream_joins_to_the_whole_answer(client):
    extra = {"thinking_token_budget": 7}  # the alias
    whole = client.chat.completions.create(**GREEDY, extra_body=extra)
    thoughts, answer, usage, finish = [], [], None, []
    for chunk in client.chat.completions.create(**GREEDY, extra_body=extra, stream=True,
                                                stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            delta = choice.delta
            thought = reasoning_of(delta)
            if thought:
                assert delta.model_extra.get("reasoning") == thought
                thoughts.append(thought)
            answer.append(delta.content or "")
            if choice.finish_reason is not None:
                finish.append(choice.finish_reason)
    message = whole.choices[0].message
    assert "".join(thoughts) == reasoning_of(message)
    assert "".join(answer) == message.content
    assert finish == [whole.choices[0].finish_reason]
    assert usage.completion_tokens_details.reasoning_tokens == 7
    assert usage.completion_tokens_details.reasoning_tokens == whole.usage.completion_tokens_details.reasoning_tokens
    assert usage.completion_tokens == whole.usage.completion_tokens


@pytest.mark.slow
def test_enable_thinking_false_makes_everything_content(client):
    reply = client.chat.completions.create(**GREEDY, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    message = reply.choices[0].message
    assert reply.usage.completion_tokens_details.reasoning_tokens == 0
    assert not reasoning_of(message)
    assert message.content and message.content.strip()


@pytest.mark.slow
def test_completions_keep_the_raw_text(server):
    tok = model_files.load_tokenizer(model_files.resolve_model(None))
    # Token ids, so the prompt ends in the start marker exactly as the tokenizer spells it alone.
    prompt = [tok(text, add_special_tokens=False)["input_ids"] for text in
              ("Question: why is the sky blue?\nAnswer:", "<think>", "\n")]
    prompt = [t for part in prompt for t in part]
    reply = httpx.post(server.url + "/v1/completions", timeout=300, json={
        "model": MODEL, "prompt": prompt, "max_tokens": 20, "temperature": 0, "thinking_budget": 3})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert "</think>" in body["choices"][0]["text"]
    assert body["usage"]["completion_tokens_details"]["reasoning_tokens"] == 3


@pytest.mark.slow
@pytest.mark.parametrize("field, value", [("thinking_budget", -1), ("thinking_token_budget", -5),
                                          ("thinking_budget", 1.5), ("thinking_budget", "7")])
def test_bad_budget_is_a_400(server, field, value):
    reply = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                       json={**GREEDY, field: value})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] in (field, "thinking_budget")


# ---- a fake worker: exact text around the markers, and a server without a parser ---------------


@pytest.fixture(scope="module")
def script(files) -> list[int]:
    return model_files.load_tokenizer(files)(SCRIPTED, add_special_tokens=False)["input_ids"]


def fake_server(files, script, **settings):
    config = WorkerConfig(model=str(files.path), served_model_name=MODEL, max_model_len=256)
    app = build_app(ServerSettings(worker=config, served_model_names=[MODEL], **settings),
                    lambda: FakeWorkerProcess(config, script, step_s=0.001))
    return server_in_thread(app)


@pytest.fixture(scope="module")
def fake_reasoning_url(files, script):
    with fake_server(files, script, reasoning_parser="deepseek_r1") as url:
        yield url


@pytest.fixture(scope="module")
def fake_plain_url(files, script):
    with fake_server(files, script) as url:
        yield url


def chat(url, script, **fields):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Say it."}], "max_tokens": len(script),
            **fields}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=60)


def test_markers_never_reach_the_text(fake_reasoning_url, script):
    reply = chat(fake_reasoning_url, script).json()
    message = reply["choices"][0]["message"]
    assert message["reasoning_content"] == message["reasoning"] == "\nThink 思考 😀 about it."
    assert message["content"] == "\n\nThe answer 世界 is here. Done 👍🏽."
    tok = model_files.load_tokenizer(model_files.resolve_model(None))
    think = len(tok("<think>\nThink 思考 😀 about it.", add_special_tokens=False)["input_ids"])
    start = len(tok("<think>", add_special_tokens=False)["input_ids"])
    assert reply["usage"]["completion_tokens_details"]["reasoning_tokens"] == think - start

    raw = chat(fake_reasoning_url, script, stream=True, stream_options={"include_usage": True}).content
    events = sse_events(raw)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    thoughts = "".join(c["choices"][0]["delta"].get("reasoning_content") or "" for c in chunks if c["choices"])
    answer = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    for c in chunks:
        for choice in c["choices"]:
            for key in ("reasoning_content", "content"):
                assert_clean(choice["delta"].get(key))
    assert thoughts == message["reasoning_content"] and answer == message["content"]
    assert chunks[-1]["usage"]["completion_tokens_details"] == reply["usage"]["completion_tokens_details"]


def test_stop_strings_apply_to_the_answer_only(fake_reasoning_url, script):
    full = chat(fake_reasoning_url, script).json()["choices"][0]["message"]
    in_thinking = chat(fake_reasoning_url, script, stop=["about"]).json()["choices"][0]
    assert in_thinking["message"]["content"] == full["content"]
    cut = chat(fake_reasoning_url, script, stop=["is here"]).json()["choices"][0]
    assert cut["finish_reason"] == "stop" and cut["stop_reason"] == "is here"
    assert cut["message"]["content"] == "\n\nThe answer 世界 "
    assert cut["message"]["reasoning_content"] == full["reasoning_content"]


def test_budget_without_a_parser_is_a_400(fake_plain_url, script):
    reply = chat(fake_plain_url, script, thinking_budget=4)
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == "thinking_budget" and "reasoning parser" in error["message"]
    plain = chat(fake_plain_url, script).json()
    message = plain["choices"][0]["message"]
    assert "reasoning_content" not in message and "completion_tokens_details" not in plain["usage"]
    assert message["content"] == SCRIPTED  # no parser: the markers are ordinary text
