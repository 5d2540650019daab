"""`spillway chat` and `spillway complete`: clients of a running server, as `vllm chat|complete`.

Each line read from stdin is sent (chat: as the next user message, after the whole
conversation so far; complete: as a prompt of its own) and the answer is streamed to stdout as
it arrives. `--quick TEXT` sends one message and exits. A request the server refuses prints
its error and the session goes on (the refused message is not kept in the history); a server
that cannot be reached ends the command with status 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

DEFAULT_URL = "http://localhost:8000/v1"
# The wait between two chunks of an answer: the server bounds a step by --worker-step-timeout
# (600 s by default), so a client that waits as long never gives up on an answer still coming.
TIMEOUT_S = 600.0


class ServerError(Exception):
    """The server answered with an error (HTTP status or an error event in the stream)."""


def _add_query_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default=DEFAULT_URL, help="the server's OpenAI API (default %(default)s)")
    parser.add_argument("--model-name", "--model", dest="model_name",
                        help="the model to ask for (default: the first of the server's /v1/models)")
    parser.add_argument("--api-key", help="sent as `Authorization: Bearer KEY` (default: $OPENAI_API_KEY)")


def add_parsers(commands) -> None:
    chat = commands.add_parser("chat", help="chat with a running server: one message per line of stdin",
                               allow_abbrev=False)
    _add_query_args(chat)
    chat.add_argument("--system-prompt", help="the conversation's system message")
    chat.add_argument("-q", "--quick", metavar="MESSAGE", help="send one message, print the answer, exit")
    complete = commands.add_parser("complete", help="complete prompts with a running server: one per line of stdin",
                                   allow_abbrev=False)
    _add_query_args(complete)
    complete.add_argument("-q", "--quick", metavar="PROMPT", help="complete one prompt, print it, exit")


class Session:
    """One server, one model: streams chat or completion answers to `out`."""

    def __init__(self, url: str, api_key: str | None, model: str | None, out) -> None:
        import httpx

        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=url.rstrip("/"), headers=headers, trust_env=False,
                                 timeout=httpx.Timeout(TIMEOUT_S, connect=10.0))
        self.out = out
        self.model = model or self._first_model()

    def _first_model(self) -> str:
        response = self.http.get("/models")
        _raise_for_error(response)
        models = response.json().get("data") or []
        if not models:
            raise ServerError("the server lists no model at /models")
        return models[0]["id"]

    def chat(self, messages: list[dict]) -> str:
        return self._stream("/chat/completions", {"messages": messages},
                            lambda choice: (choice.get("delta") or {}).get("content"))

    def complete(self, prompt: str) -> str:
        return self._stream("/completions", {"prompt": prompt}, lambda choice: choice.get("text"))

    def _stream(self, path: str, body: dict, text_of) -> str:
        pieces = []
        with self.http.stream("POST", path, json={"model": self.model, "stream": True, **body}) as response:
            if response.status_code != 200:
                response.read()
                _raise_for_error(response)
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    raise ServerError(_message(event))
                for choice in event.get("choices") or []:
                    text = text_of(choice)
                    if text:
                        pieces.append(text)
                        self.out.write(text)
                        self.out.flush()
        self.out.write("\n")
        self.out.flush()
        return "".join(pieces)

    def close(self) -> None:
        self.http.close()


def _message(body) -> str:
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        return str(error.get("message", error))
    return str(error if error is not None else body)


def _raise_for_error(response) -> None:
    if response.status_code == 200:
        return
    try:
        message = _message(response.json())
    except ValueError:
        message = response.text[:500]
    raise ServerError(f"HTTP {response.status_code}: {message}")


def _lines(stdin, out, greeting: str):
    """Non-empty lines of stdin, each after a `> ` prompt (as vLLM's client writes them)."""
    print(greeting, file=out, flush=True)
    while True:
        out.write("> ")
        out.flush()
        line = stdin.readline()
        if not line:
            out.write("\n")
            return
        if line.strip():
            yield line.rstrip("\n")


def run_chat(args: argparse.Namespace, stdin=None, out=None) -> int:
    def converse(session: Session, out) -> None:
        history = [{"role": "system", "content": args.system_prompt}] if args.system_prompt else []
        messages = [args.quick] if args.quick is not None else \
            _lines(stdin or sys.stdin, out, "Please enter a message for the chat model:")
        for message in messages:
            turn = history + [{"role": "user", "content": message}]
            try:
                reply = session.chat(turn)
            except ServerError as exc:
                if args.quick is not None:
                    raise
                print(f"spillway chat: {exc}", file=sys.stderr)
                continue
            history = turn + [{"role": "assistant", "content": reply}]

    return _run("chat", args, converse, out)


def run_complete(args: argparse.Namespace, stdin=None, out=None) -> int:
    def complete(session: Session, out) -> None:
        prompts = [args.quick] if args.quick is not None else \
            _lines(stdin or sys.stdin, out, "Please enter prompt to complete:")
        for prompt in prompts:
            try:
                session.complete(prompt)
            except ServerError as exc:
                if args.quick is not None:
                    raise
                print(f"spillway complete: {exc}", file=sys.stderr)

    return _run("complete", args, complete, out)


def _run(command: str, args: argparse.Namespace, body, out) -> int:
    import httpx

    out = out or sys.stdout
    session = None
    try:
        session = Session(args.url, args.api_key or os.environ.get("OPENAI_API_KEY"), args.model_name, out)
        print(f"Using model: {session.model}", file=out, flush=True)
        body(session, out)
        return 0
    except ServerError as exc:
        print(f"spillway {command}: {exc}", file=sys.stderr)
        return 1
    except httpx.HTTPError as exc:
        print(f"spillway {command}: cannot reach {args.url}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        if session is not None:
            session.close()
