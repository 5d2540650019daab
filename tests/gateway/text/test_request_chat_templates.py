"""Chat templates sent with requests (fake worker): refused unless the server trusts them
(--trust-request-chat-template), and then rendered in a child process within bounds on time,
memory and output, while /health answers and the gateway's memory stays flat."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import httpx
import pytest

from server_helpers import MODEL, fake_app, server_in_thread
from spillway.gateway.cli.main import _server_settings
from spillway.gateway.cli.serve_args import build_parser
from spillway.gateway.text.template_sandbox import TemplateLimits
from spillway.protocol.local import model_files

MESSAGES = [{"role": "user", "content": "Hi"}]
CHAT = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2}
TEMPLATE = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
BOMB = '{% for a in range(100000) %}{{ "x" * 100000 }}{% endfor %}'
TIMEOUT_S = 1.5
MEMORY_MIB = 512
# What the gateway may grow by while templates go past their bounds: one request and one reply
# frame of at most 4 x 256 tokens x the longest token's characters (~80 KB here), and the
# allocator's slack; a template rendered in the gateway took gigabytes.
GATEWAY_GROWTH_BYTES = 64 << 20
PAST_THE_BOUNDS = {
    "memory": BOMB,
    "one huge string": '{{ "x" * 10**11 }}',
    "namespace doubling": '{% set ns = namespace(s="x") %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}'
                          '{% endfor %}{{ ns.s|length }}',
    "time": "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}",
    "output": '{{ "x" * 100000 }}',
}
STOPPED_BY = {"memory": "memory", "one huge string": "memory", "namespace doubling": "memory",
              "time": f"longer than {TIMEOUT_S:g} s", "output": "characters"}


@pytest.fixture(scope="module")
def script(files) -> list[int]:
    return model_files.load_tokenizer(files)("Hello", add_special_tokens=False)["input_ids"]


def test_request_templates_are_refused_without_the_trust_flag(files, script):
    app, _ = fake_app(files, script)
    with server_in_thread(app) as url:
        # Those a server that renders them fails on first: the bomb rendered in-process takes ~10 GB.
        for path, body in (
            ("/v1/chat/completions", {**CHAT, "chat_template_kwargs": {"chat_template": BOMB}}),
            ("/tokenize", {"messages": MESSAGES, "chat_template": BOMB}),
            ("/tokenize", {"messages": MESSAGES, "chat_template_kwargs": {"chat_template": BOMB}}),
            ("/v1/chat/completions", {**CHAT, "chat_template": BOMB}),
            ("/invocations", {**CHAT, "chat_template": BOMB}),
        ):
            answer = httpx.post(url + path, json=body, timeout=30)
            assert answer.status_code == 400, (path, answer.text)
            error = answer.json()["error"]
            assert (error["param"], error["code"]) == ("chat_template", "untrusted_chat_template"), (path, error)
            assert "--trust-request-chat-template" in error["message"]
        # The server's own template (the model's) still renders, and other template variables pass.
        plain = httpx.post(url + "/v1/chat/completions", json={**CHAT, "chat_template_kwargs": {"x": 1}}, timeout=30)
        assert plain.status_code == 200, plain.text


def _vm_bytes(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} for {pid}")


class Watch:
    """Samples /health's latency, the gateway's resident memory and the renderer's address space."""

    def __init__(self, url: str, sandbox) -> None:
        self.url, self.sandbox = url, sandbox
        self.health_s: list[float] = []
        self.gateway_rss: list[int] = []
        self.renderer_vm: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=30) as client:
            while not self._stop.is_set():
                started = time.monotonic()
                assert client.get(self.url + "/health").status_code == 200
                self.health_s.append(time.monotonic() - started)
                self.gateway_rss.append(_vm_bytes(os.getpid(), "VmRSS"))
                try:
                    self.renderer_vm.append(_vm_bytes(self.sandbox.pid, "VmSize"))
                except (FileNotFoundError, TypeError, AssertionError):
                    pass  # between a killed renderer and its replacement
                time.sleep(0.02)

    def __enter__(self) -> Watch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(30)


def test_trusted_templates_stop_at_each_bound_while_health_answers(files, script):
    app, _ = fake_app(files, script, trust_request_chat_template=True,
                      request_template_limits=TemplateLimits(timeout_s=TIMEOUT_S, memory_mib=MEMORY_MIB))
    with server_in_thread(app) as url:
        tokenizer = app.state.gateway.tokenizer.tokenizer
        sandbox = app.state.gateway.sandbox
        expected = tokenizer("[user]Hi", add_special_tokens=False)["input_ids"]
        tokenized = httpx.post(url + "/tokenize", json={"messages": MESSAGES, "chat_template": TEMPLATE}, timeout=60)
        assert tokenized.json()["tokens"] == expected, tokenized.text  # the renderer has started
        with Watch(url, sandbox) as watch:
            baseline = _vm_bytes(os.getpid(), "VmRSS")
            for name, template in PAST_THE_BOUNDS.items():
                for body in ({**CHAT, "chat_template": template},
                             {**CHAT, "chat_template_kwargs": {"chat_template": template}}):
                    answer = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
                    assert answer.status_code == 400, (name, answer.text)
                    error = answer.json()["error"]
                    assert (error["param"], error["code"]) == ("chat_template", "chat_template_limit"), (name, error)
                    assert STOPPED_BY[name] in error["message"], (name, error)
        assert max(watch.gateway_rss) - baseline < GATEWAY_GROWTH_BYTES, (max(watch.gateway_rss), baseline)
        assert 0 < max(watch.renderer_vm) <= MEMORY_MIB << 20
        assert len(watch.health_s) > 20 and max(watch.health_s) < 0.5, max(watch.health_s)
        # After all that, a trusted template of a request still renders: chat, /tokenize, /invocations.
        chat = httpx.post(url + "/v1/chat/completions", json={**CHAT, "chat_template": TEMPLATE}, timeout=60)
        assert chat.status_code == 200 and chat.json()["usage"]["prompt_tokens"] == len(expected), chat.text
        nested = httpx.post(url + "/tokenize", json={"messages": MESSAGES, "chat_template_kwargs": {
            "chat_template": "{{ greeting }}" + TEMPLATE, "greeting": "Ahoy"}}, timeout=60)
        assert nested.json()["tokens"] == tokenizer("Ahoy[user]Hi", add_special_tokens=False)["input_ids"]
        invoked = httpx.post(url + "/invocations", json={**CHAT, "chat_template": TEMPLATE}, timeout=60)
        assert invoked.status_code == 200 and invoked.json()["usage"]["prompt_tokens"] == len(expected)
        broken = httpx.post(url + "/v1/chat/completions", json={**CHAT, "chat_template": "{% for %}"}, timeout=60)
        assert broken.status_code == 400 and broken.json()["error"]["param"] == "messages"


def test_serve_flags_set_the_trust_and_the_bounds(capsys):
    settings = _server_settings(build_parser().parse_args([
        "serve", "--trust-request-chat-template", "--request-chat-template-timeout", "0.5",
        "--request-chat-template-memory-mb", "300"]))
    assert settings.trust_request_chat_template is True
    assert settings.request_template_limits == TemplateLimits(timeout_s=0.5, memory_mib=300)
    defaults = _server_settings(build_parser().parse_args(["serve"]))
    assert defaults.trust_request_chat_template is False
    assert defaults.request_template_limits == TemplateLimits(timeout_s=2.0, memory_mib=1024)
    for timeout_s, memory_mib, named in ((0.0, 1024, "--request-chat-template-timeout"),
                                         (float("nan"), 1024, "--request-chat-template-timeout"),
                                         (1.0, 100, "--request-chat-template-memory-mb")):
        with pytest.raises(ValueError, match=named):
            TemplateLimits(timeout_s, memory_mib)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--trust-request-chat-template" in help_text and "(default 2)" in help_text and "(default 1024)" in help_text
