"""Each row of test_request_fields.py's table sent to the gateway (fake worker), against the request without it."""

from __future__ import annotations

import uuid

import httpx
import pytest
from tokenizers.processors import TemplateProcessing

from fake_worker import FakeWorkerProcess
from server_helpers import MODEL, server_in_thread
from spillway.gateway.http.app import ServerSettings, build_app
from spillway.protocol.local import model_files
from spillway.protocol.config import WorkerConfig
from spillway.protocol.messages import Generate
from tests.gateway.api.test_request_fields import BOS, CHAT, COMPLETION, OUTPUT, REFUSED, ROWS, SCRIPT, Sent

BASE = {CHAT: {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
        COMPLETION: {"model": MODEL, "prompt": "Hi there", "max_tokens": 4}}


@pytest.fixture(scope="module")
def server():
    files = model_files.resolve_model(None)
    tokenizer = model_files.load_tokenizer(files)
    SCRIPT[:] = tokenizer(OUTPUT, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    config = WorkerConfig(model=str(files.path), served_model_name=MODEL, max_model_len=256)
    # The table's chat_template rows send templates of their own: rendered by the sandbox's child.
    app = build_app(ServerSettings(worker=config, served_model_names=[MODEL], trust_request_chat_template=True),
                    lambda: FakeWorkerProcess(config, SCRIPT))
    with server_in_thread(app) as url:
        gateway = app.state.gateway
        gateway.tokenizer.tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
            single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", BOS)])
        received: list[Generate] = []
        submit = gateway.client.submit

        def recording_submit(generates, *args, **kwargs):
            received.extend(generates)
            return submit(generates, *args, **kwargs)

        gateway.client.submit = recording_submit

        def send(path: str, fields: dict) -> Sent:
            received.clear()
            response = httpx.post(url + path, json={**BASE[path], **fields}, timeout=30)
            answer = response.text if fields.get("stream") and response.status_code == 200 else response.json()
            return Sent(response.status_code, answer, list(received))

        yield send, tokenizer


@pytest.mark.parametrize("path,field,fields,expected", ROWS,
                         ids=[f"{'chat' if p == CHAT else 'completion'}-{f}-{i}" for i, (p, f, _, _) in enumerate(ROWS)])
def test_field_is_honoured_or_refused_by_name(server, path, field, fields, expected):
    send, tokenizer = server
    sent = send(path, fields)
    if expected is REFUSED:
        assert sent.status == 400, sent.answer
        assert sent.answer["error"]["param"] == field, sent.answer
        assert field in sent.answer["error"]["message"] or sent.answer["error"]["message"].startswith(
            "Expected"), sent.answer
        assert not sent.generates
    else:
        assert sent.status == 200, sent.answer
        expected(sent, send(path, {k: v for k, v in fields.items() if k != field}), tokenizer)


def test_fields_unknown_to_vllm_are_still_ignored(server):
    send, _ = server
    sent = send(CHAT, {"store": True, "metadata": {"k": "v"}, "service_tier": "auto", str(uuid.uuid4()): 1})
    assert sent.status == 200 and sent.text() == OUTPUT
