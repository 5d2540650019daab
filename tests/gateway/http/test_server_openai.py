"""End to end: `spillway serve` with the real default model, driven by the official openai
client, raw HTTP (the SSE wire format as curl shows it) and a table of bad requests."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from server_helpers import MODEL, real_server, scrape, sse_events

BODY_LIMIT = 1 << 20
CHAT_PROMPT = [{"role": "user", "content": "Write one sentence about rivers."}]

pytestmark = pytest.mark.slow  # starts `spillway serve` with the real default model


@pytest.fixture(scope="module")
def server():
    with real_server("--max-request-body-bytes", str(BODY_LIMIT), "--max-model-len", "2048") as running:
        yield running


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_models_lists_the_served_model(client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].model_extra["max_model_len"] == 2048


def test_streamed_chat_joins_to_the_whole_answer(client):
    kwargs = dict(model=MODEL, messages=CHAT_PROMPT, max_tokens=48, temperature=0.8, seed=1234)
    whole = client.chat.completions.create(**kwargs)
    pieces, finish_reasons, usage = [], [], None
    for chunk in client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            if choice.finish_reason is not None:
                finish_reasons.append(choice.finish_reason)
    text = whole.choices[0].message.content
    assert text and "\ufffd" not in text
    assert "".join(pieces) == text
    assert finish_reasons == [whole.choices[0].finish_reason]
    assert usage.completion_tokens == whole.usage.completion_tokens
    assert usage.prompt_tokens == whole.usage.prompt_tokens


def test_completions_whole_streamed_and_from_token_ids(server, client):
    kwargs = dict(model=MODEL, prompt="The capital of France is", max_tokens=12, temperature=0)
    whole = client.completions.create(**kwargs)
    assert whole.usage.completion_tokens == 12 or whole.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kwargs, stream=True) if c.choices)
    assert streamed == whole.choices[0].text
    token_ids = httpx.post(server.url + "/tokenize", json={"prompt": kwargs["prompt"]}).json()["tokens"]
    from_ids = client.completions.create(**{**kwargs, "prompt": token_ids})
    assert from_ids.choices[0].text == whole.choices[0].text
    assert from_ids.usage.prompt_tokens == len(token_ids)


def test_stop_string_cuts_the_greedy_answer(client):
    kwargs = dict(model=MODEL, messages=CHAT_PROMPT, max_tokens=40, temperature=0)
    text = client.chat.completions.create(**kwargs).choices[0].message.content
    stop = text[len(text) // 2: len(text) // 2 + 3]
    cut = client.chat.completions.create(**kwargs, stop=[stop]).choices[0]
    assert cut.message.content == text[:text.index(stop)]
    assert cut.finish_reason == "stop"
    assert cut.model_extra["stop_reason"] == stop


def test_repeated_prompt_reports_cached_tokens(client):
    # A system message of its own, so not even the template's first block was seen before.
    messages = [{"role": "system", "content": "You test prefix caching."},
                {"role": "user", "content": "Cache me: " + " ".join(f"item{i}" for i in range(60))}]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    second = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    prompt_tokens = first.usage.prompt_tokens
    assert prompt_tokens > 64
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached % 16 == 0 and (prompt_tokens // 16 - 1) * 16 <= cached < prompt_tokens


def test_greedy_logprobs_rank_the_sampled_token_first(client):
    reply = client.chat.completions.create(model=MODEL, messages=CHAT_PROMPT, max_tokens=5, temperature=0,
                                           logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)


def test_32_concurrent_streams_all_finish(server):
    async def one(client: openai.AsyncOpenAI, index: int):
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Count from {index} upwards."}], max_tokens=16,
            temperature=0.7, seed=index, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True})
        text, finish, usage = "", None, None
        async for chunk in stream:
            usage = chunk.usage or usage
            for choice in chunk.choices:
                text += choice.delta.content or ""
                finish = choice.finish_reason or finish
        return text, finish, usage

    async def run():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                                      timeout=300) as client:
            return await asyncio.gather(*(one(client, i) for i in range(32)))

    results = asyncio.run(run())
    assert len(results) == 32
    for text, finish, usage in results:
        assert finish == "length"
        assert usage.completion_tokens == 16
        assert text and "\ufffd" not in text
    assert scrape(server.url)["vllm:num_requests_running"] == 0


def test_sse_wire_format(server):
    body = {"model": MODEL, "messages": CHAT_PROMPT, "max_tokens": 6, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"] == "text/event-stream; charset=utf-8"
        events = sse_events(response.read())
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert {c["id"] for c in chunks} == {chunks[0]["id"]} and chunks[0]["id"].startswith("chatcmpl-")
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == MODEL for c in chunks)
    first, *content, finish, usage = chunks
    assert first["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                 "finish_reason": None, "stop_reason": None}]
    assert content and all(list(c["choices"][0]["delta"]) == ["content"] for c in content)
    assert all(c["choices"][0]["finish_reason"] is None and "usage" not in c for c in content)
    assert finish["choices"] == [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length",
                                  "stop_reason": None}]
    assert usage["choices"] == []
    assert usage["usage"]["completion_tokens"] == 6
    assert usage["usage"]["total_tokens"] == usage["usage"]["prompt_tokens"] + 6
    assert set(usage["usage"]["prompt_tokens_details"]) == {"cached_tokens"}


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
BAD_REQUESTS = [
    # (case, path, body: dict or raw bytes, status, param)
    ("malformed JSON", "/v1/chat/completions", b'{"messages": [', 400, None),
    ("JSON that is not an object", "/v1/chat/completions", b"[1, 2]", 400, None),
    ("JSON nested too deeply", "/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"a": '
     + b"[" * 100_000 + b"]" * 100_000 + b"}}", 400, None),
    ("invalid UTF-8", "/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "\xff\xfe"}], "max_tokens": 4}', 400, None),
    ("messages of the wrong type", "/v1/chat/completions", {**CHAT, "messages": "hi"}, 400, "messages"),
    ("role of the wrong type", "/v1/chat/completions", {**CHAT, "messages": [{"role": 1}]}, 400,
     "messages[0].role"),
    ("max_tokens of the wrong type", "/v1/chat/completions", {**CHAT, "max_tokens": "4"}, 400, "max_tokens"),
    ("missing messages", "/v1/chat/completions", {"model": MODEL}, 400, "messages"),
    ("empty messages", "/v1/chat/completions", {**CHAT, "messages": []}, 400, "messages"),
    ("non-text content part", "/v1/chat/completions",
     {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages[0].content"),
    ("unknown model", "/v1/chat/completions", {**CHAT, "model": "gpt-9"}, 404, "model"),
    ("prompt plus max_tokens over max_model_len", "/v1/chat/completions", {**CHAT, "max_tokens": 2040}, 400,
     "messages"),
    ("prompt alone over max_model_len", "/v1/completions", {"prompt": [11] * 2048}, 400, "prompt"),
    ("token id outside the vocabulary", "/v1/completions", {"prompt": [1, 10**9]}, 400, "prompt"),
    ("empty prompt", "/v1/completions", {"prompt": []}, 400, "prompt"),
    ("n over the limit", "/v1/chat/completions", {**CHAT, "n": 129}, 400, "n"),
    ("top_logprobs over the limit", "/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21}, 400,
     "top_logprobs"),
    ("completion logprobs over the limit", "/v1/completions", {"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ("negative temperature", "/v1/chat/completions", {**CHAT, "temperature": -1}, 400, "temperature"),
    ("zero max_tokens", "/v1/chat/completions", {**CHAT, "max_tokens": 0}, 400, "max_tokens"),
    ("seed too large", "/v1/chat/completions", {**CHAT, "seed": 2**70}, 400, "seed"),
    ("too many stop strings", "/v1/chat/completions", {**CHAT, "stop": [str(i) for i in range(17)]}, 400, "stop"),
    ("tools", "/v1/chat/completions", {**CHAT, "tools": [{"type": "function"}]}, 400, "tools"),
    ("chat_template_kwargs clashing with the template call", "/v1/chat/completions",
     {**CHAT, "chat_template_kwargs": {"tokenize": True}}, 400, "messages"),
    ("body over the size limit", "/v1/chat/completions",
     {**CHAT, "messages": [{"role": "user", "content": "x" * BODY_LIMIT}]}, 413, None),
    ("tokenize without a prompt", "/tokenize", {}, 400, "prompt"),
    ("detokenize outside the vocabulary", "/detokenize", {"tokens": [-1]}, 400, "tokens"),
]


@pytest.mark.parametrize("case, path, body, status, param", BAD_REQUESTS, ids=[c[0] for c in BAD_REQUESTS])
def test_bad_request_gets_a_4xx_with_an_error_body(server, case, path, body, status, param):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(server.url + path, content=content, headers={"content-type": "application/json"},
                          timeout=60)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str)
    assert error["param"] == param


def test_wrong_method_and_unknown_route_get_error_bodies(server):
    wrong_method = httpx.get(server.url + "/v1/chat/completions")
    assert wrong_method.status_code == 405 and "error" in wrong_method.json()
    unknown = httpx.get(server.url + "/v1/nothing")
    assert unknown.status_code == 404 and "error" in unknown.json()


def test_server_is_healthy_after_bad_requests(server, client):
    for _, path, body, _, _ in BAD_REQUESTS:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        httpx.post(server.url + path, content=content, timeout=60)
    assert httpx.get(server.url + "/health").status_code == 200
    reply = client.chat.completions.create(model=MODEL, messages=CHAT_PROMPT, max_tokens=4, temperature=0)
    assert reply.choices[0].message.content


def test_tokenize_detokenize_version_and_metrics(server):
    tokens = httpx.post(server.url + "/tokenize", json={"prompt": "Hello world"}).json()
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 2048
    text = httpx.post(server.url + "/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"]
    assert text == "Hello world"
    chat = httpx.post(server.url + "/tokenize", json={"messages": CHAT_PROMPT}).json()
    assert chat["count"] > tokens["count"]
    assert httpx.get(server.url + "/version").json()["version"]
    metrics = scrape(server.url)
    for name in ["vllm:gpu_cache_usage_perc", "vllm:cpu_cache_usage_perc", "vllm:prefix_cache_hit_rate",
                 "vllm:prefix_cache_miss_rate", "vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries_total",
                 "vllm:prefix_cache_hits_total", "vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:num_preemptions_total", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                 'vllm:request_success_total{finished_reason="stop"}', "vllm:time_to_first_token_seconds_count",
                 "vllm:inter_token_latency_seconds_count", "vllm:e2e_request_latency_seconds_count"]:
        assert name in metrics, name
    assert metrics["vllm:prefix_cache_hits_total"] > 0
    assert metrics["vllm:prefix_cache_hit_rate"] + metrics["vllm:prefix_cache_miss_rate"] == pytest.approx(1)
    assert metrics["spillway:kv_invariants_ok"] == 1
