"""`spillway chat` and `spillway complete` through a pipe, against the gateway over a fake worker
that answers every request with the same reply: what stdout shows, and what the server was sent
(chat keeps the conversation; a refused request is reported and the session goes on)."""

from __future__ import annotations

import subprocess

import pytest

from ports import HOST, reserve_ports
from recording_app import Recording
from server_helpers import MODEL, fake_app, server_in_thread, spillway_command
from spillway.gateway.api.request_defaults import RequestDefaults
from spillway.protocol.local import model_files

REPLY = " The sky is blue."
GREETING = "Please enter a message for the chat model:"


@pytest.fixture(scope="module")
def server(files):
    script = model_files.load_tokenizer(files)(REPLY, add_special_tokens=False)["input_ids"]
    # The fake worker stops only at max_tokens: the server's default one ends the reply with the script.
    app, _ = fake_app(files, script, request_defaults=RequestDefaults(max_tokens=len(script)))
    recording = Recording(app)
    with server_in_thread(recording) as url:
        yield url, recording


@pytest.fixture
def posts(server):
    server[1].posts.clear()
    return server[1]


def client(command: str, url: str, *args: str, stdin: str = "") -> subprocess.CompletedProcess:
    return subprocess.run([*spillway_command(), command, "--url", url + "/v1", *args], input=stdin,
                          capture_output=True, text=True, timeout=60)


def test_chat_streams_each_reply_and_sends_the_whole_conversation(server, posts):
    done = client("chat", server[0], "--system-prompt", "Answer briefly.",
                  stdin="What colour is the sky?\n\nAnd the sea?\n")
    assert done.returncode == 0, done.stderr
    # The empty line is skipped: its prompt stays on the line the next answer is written to.
    assert done.stdout == f"Using model: {MODEL}\n{GREETING}\n> {REPLY}\n> > {REPLY}\n> \n"
    first, second = posts.bodies("/v1/chat/completions")
    assert first["model"] == second["model"] == MODEL and first["stream"] is True
    assert first["messages"] == [{"role": "system", "content": "Answer briefly."},
                                 {"role": "user", "content": "What colour is the sky?"}]
    assert second["messages"] == first["messages"] + [{"role": "assistant", "content": REPLY},
                                                      {"role": "user", "content": "And the sea?"}]


def test_chat_quick_sends_one_message_and_exits(server, posts):
    done = client("chat", server[0], "--quick", "Hi", "--model-name", MODEL)
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"Using model: {MODEL}\n{REPLY}\n"
    assert [body["messages"] for body in posts.bodies("/v1/chat/completions")] == [[{"role": "user", "content": "Hi"}]]


def test_complete_sends_each_line_as_a_prompt_of_its_own(server, posts):
    done = client("complete", server[0], stdin="Once upon\nThe end\n")
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"Using model: {MODEL}\nPlease enter prompt to complete:\n> {REPLY}\n> {REPLY}\n> \n"
    assert [body["prompt"] for body in posts.bodies("/v1/completions")] == ["Once upon", "The end"]


def test_a_refused_request_is_reported_and_the_chat_goes_on(server, posts):
    # Each message is longer than the fake worker's 256-token context: the server refuses both.
    long = " ".join(["word"] * 400)
    done = client("chat", server[0], stdin=f"{long}\nShort one\n")
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"Using model: {MODEL}\n{GREETING}\n> > {REPLY}\n> \n"
    assert done.stderr.startswith("spillway chat: HTTP 400: ") and done.stderr.count("\n") == 1
    refused, answered = posts.bodies("/v1/chat/completions")
    assert answered["messages"] == [{"role": "user", "content": "Short one"}]  # the refused one left out


def test_quick_with_a_model_the_server_lacks_fails_with_the_servers_message(server):
    done = client("complete", server[0], "--model-name", "nope", "-q", "Hi")
    assert done.returncode == 1
    assert done.stdout == "Using model: nope\n"
    assert done.stderr.startswith("spillway complete: HTTP 404: ") and "nope" in done.stderr


def test_a_server_that_is_not_there_ends_the_command():
    with reserve_ports(1) as (port,):  # reserved, so nothing listens on it
        done = client("chat", f"http://{HOST}:{port}", "-q", "Hi")
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.startswith(f"spillway chat: cannot reach http://{HOST}:{port}/v1: ConnectError")
