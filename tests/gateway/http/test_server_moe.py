"""`spillway serve` on a tiny random Qwen3-MoE (CPU, float32) whose tokenizer, SmolLM2's, has
<think> and </think> as single tokens and a chat template that opens thinking; the model never
closes it by itself. One server for every check (starts are slow): the openai client's answer,
reasoning streamed apart from the answer with the qwen3 parser, a thinking budget, and the
prefix-cache hits of a repeated prompt in /metrics."""

from __future__ import annotations

import sys
from pathlib import Path

import openai
import pytest

from server_helpers import metrics_when, real_server
from spillway.protocol.local import model_files

sys.path.insert(0, str(Path(__file__).parents[2] / "worker"))
from tiny_models import save_tiny_thinker, tiny_qwen3_moe  # noqa: E402

SERVED = "tiny-moe"
BUDGET, MAX_TOKENS = 5, 16
BLOCK_SIZE = 16
QUESTION = [{"role": "user", "content": "Which rivers cross the plain, and where do they meet the sea? "
                                        "Name each one and say how long it is."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-qwen3-moe-thinker")
    tokenizer = model_files.load_tokenizer(model_files.resolve_model(None))
    template = tokenizer.chat_template + "{% if add_generation_prompt %}{{ '<think>\n' }}{% endif %}"
    model, _, _ = save_tiny_thinker(folder / "model", tokenizer,
                                    lambda vocab_size: tiny_qwen3_moe(vocab_size=vocab_size, eos_token_id=2))
    (folder / "template.jinja").write_text(template)
    with real_server(model, "--device", "cpu", "--dtype", "float32", "--max-model-len", "256",
                     "--num-gpu-blocks-override", "64", "--served-model-name", SERVED,
                     "--reasoning-parser", "qwen3", "--chat-template", str(folder / "template.jinja")) as running:
        yield running


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def ask(client: openai.OpenAI, **options):
    return client.chat.completions.create(model=SERVED, messages=QUESTION, max_tokens=MAX_TOKENS, temperature=0,
                                          extra_body={"thinking_budget": BUDGET, "ignore_eos": True}, **options)


def reasoning_of(message_or_delta) -> str | None:
    return (message_or_delta.model_extra or {}).get("reasoning_content")


def test_a_budgeted_answer_streams_its_reasoning_apart_and_the_repeat_hits_the_prefix_cache(server, client):
    whole = ask(client)
    thoughts, answer, usage = [], [], None
    for chunk in ask(client, stream=True, stream_options={"include_usage": True}):
        usage = chunk.usage or usage
        for choice in chunk.choices:
            thoughts.append(reasoning_of(choice.delta) or "")
            answer.append(choice.delta.content or "")

    message = whole.choices[0].message
    assert whole.usage.completion_tokens_details.reasoning_tokens == BUDGET  # thinking cut at the budget
    assert whole.usage.completion_tokens == MAX_TOKENS and whole.choices[0].finish_reason == "length"
    assert reasoning_of(message) and message.content  # thinking, then the answer after </think>
    assert "<think>" not in message.content and "</think>" not in message.content
    assert "".join(thoughts) == reasoning_of(message) and "".join(answer) == message.content
    assert usage.completion_tokens_details.reasoning_tokens == BUDGET

    prompt_tokens = whole.usage.prompt_tokens
    hits = (prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE  # full blocks; the last token is recomputed
    assert hits >= 2 * BLOCK_SIZE
    assert (whole.usage.prompt_tokens_details.cached_tokens, usage.prompt_tokens_details.cached_tokens) == (0, hits)
    metrics = metrics_when(server, lambda m: m.get("vllm:prefix_cache_hits_total") == hits)
    assert metrics["vllm:prefix_cache_hits_total"] == hits
    assert metrics["vllm:prefix_cache_queries_total"] == 2 * prompt_tokens
