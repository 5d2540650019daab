"""tools/soak/served.py's traffic: a seeded mix of every kind of request the server answers, each
answer checked, failures counted by kind.

Kinds (weights in MIX): streamed and whole chat completions and completions of varied prompt
and output lengths; streams abandoned mid-way (the connection closed after a few events, as a
client that stops reading); completions with stop strings; bodies the server must refuse with
400; and the side routes /v1/models, /metrics, /tokenize and /detokenize.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from spillway.tools.bench.serve.stream_client import Exchange, send_request, split_events

MIX = (("chat_stream", 4), ("completion_stream", 4), ("chat", 2), ("completion", 2), ("abort", 2), ("stop", 2),
       ("invalid", 1), ("models", 1), ("metrics", 1), ("tokenize", 1), ("detokenize", 1))
PROMPT_WORDS = (4, 300)
OUTPUT_TOKENS = (1, 48)
ABORT_AFTER_EVENTS = (1, 8)
STOP_STRINGS = (" the", ".", ",", "\n")
# Each refused with 400 before it reaches the worker; `model` is added to the bodies.
INVALID = (("/v1/chat/completions", {"max_tokens": 4}),  # no messages
           ("/v1/chat/completions", {"messages": "hi", "max_tokens": 4}),  # not a list
           ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "temperature": "hot"}),
           ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "n": 0}),
           ("/detokenize", {"tokens": [-5]}))


@dataclass(slots=True, frozen=True)
class Call:
    """One request of the mix and what its answer must be."""

    kind: str
    method: str
    path: str
    body: dict | None = None
    expect_status: int = 200
    stream: bool = False
    max_tokens: int = 0
    exact_tokens: bool = False  # ignore_eos without stop strings: usage must equal max_tokens
    stop: tuple[str, ...] = ()
    abort_after: int | None = None  # events read before the connection is closed


def traffic(model: str, words: Sequence[str], seed: int) -> Iterator[Call]:
    """An endless seeded stream of calls, kinds drawn by MIX's weights."""
    rng = random.Random(seed)
    kinds, weights = zip(*MIX)
    while True:
        yield make_call(rng.choices(kinds, weights)[0], model, words, rng)


def make_call(kind: str, model: str, words: Sequence[str], rng: random.Random) -> Call:
    match kind:
        case "models":
            return Call(kind, "GET", "/v1/models")
        case "metrics":
            return Call(kind, "GET", "/metrics")
        case "tokenize":
            return Call(kind, "POST", "/tokenize", {"model": model, "prompt": _text(words, rng)})
        case "detokenize":
            tokens = [rng.randrange(1, 1000) for _ in range(rng.randint(1, 64))]  # inside any vocabulary
            return Call(kind, "POST", "/detokenize", {"model": model, "tokens": tokens})
        case "invalid":
            path, body = rng.choice(INVALID)
            return Call(kind, "POST", path, {"model": model, **body}, expect_status=400)
    return _generation(kind, model, words, rng)


def _generation(kind: str, model: str, words: Sequence[str], rng: random.Random) -> Call:
    chat = kind.startswith("chat") or (kind in ("abort", "stop") and rng.random() < 0.5)
    stream = kind.endswith("_stream") or kind == "abort" or (kind == "stop" and rng.random() < 0.5)
    max_tokens = rng.randint(*OUTPUT_TOKENS) if kind != "abort" else OUTPUT_TOKENS[1]
    stop = tuple(rng.sample(STOP_STRINGS, rng.randint(1, 2))) if kind == "stop" else ()
    ignore_eos = rng.random() < 0.5
    body: dict = {"model": model, "max_tokens": max_tokens, "temperature": rng.choice((0.0, 0.8)),
                  "ignore_eos": ignore_eos, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if stop:
        body["stop"] = list(stop)
    if chat:
        body["messages"] = [{"role": "user", "content": _text(words, rng)}]
    else:
        body["prompt"] = _text(words, rng)
    path = "/v1/chat/completions" if chat else "/v1/completions"
    abort_after = rng.randint(*ABORT_AFTER_EVENTS) if kind == "abort" else None
    return Call(kind, "POST", path, body, stream=stream, max_tokens=max_tokens, exact_tokens=ignore_eos and not stop,
                stop=stop, abort_after=abort_after)


def _text(words: Sequence[str], rng: random.Random) -> str:
    length = rng.randint(*PROMPT_WORDS)
    start = rng.randrange(len(words))
    return " ".join(words[(start + i) % len(words)] for i in range(length))


class Failure(Exception):
    """An answer that is not the one expected; `kind` names the way it failed."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(slots=True)
class Tally:
    """Calls done per kind, and failures per "call kind: failure kind" with the first message of each."""

    done: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    examples: dict[str, str] = field(default_factory=dict)

    def add(self, call: Call, failure: Failure | None) -> None:
        self.done[call.kind] += 1
        if failure is not None:
            key = f"{call.kind}: {failure.kind}"
            self.errors[key] += 1
            self.examples.setdefault(key, str(failure)[:300])

    @property
    def total(self) -> int:
        return sum(self.done.values())


async def drive(url: str, calls: Iterator[Call], concurrency: int, until: float, tally: Tally,
                timeout_s: float) -> None:
    """`concurrency` calls in flight until `time.monotonic()` passes `until`; each one's outcome tallied."""
    async def loop() -> None:
        while time.monotonic() < until:
            call = next(calls)
            tally.add(call, await perform(url, call, timeout_s))

    await asyncio.gather(*(loop() for _ in range(concurrency)))


async def perform(url: str, call: Call, timeout_s: float) -> Failure | None:
    """Send `call` and check its answer; the failure, or None."""
    try:
        await asyncio.wait_for(_perform(url, call), timeout_s)
    except Failure as failure:
        return failure
    except asyncio.TimeoutError:
        return Failure("timeout", f"no full answer within {timeout_s:g} s")
    except (asyncio.IncompleteReadError, ConnectionResetError, ValueError) as exc:
        return Failure("cut", f"the response broke off: {type(exc).__name__}: {exc}")
    except OSError as exc:
        return Failure("connect", f"{type(exc).__name__}: {exc}")
    return None


async def _perform(url: str, call: Call) -> None:
    body = None if call.body is None else json.dumps(call.body).encode()
    exchange = await send_request(url, call.method, call.path, body)
    try:
        if exchange.status != call.expect_status:
            raise Failure("status", f"HTTP {exchange.status}, not {call.expect_status}: "
                          f"{(await exchange.reader.read(300))!r}")
        if call.stream:
            await _check_stream(exchange, call)
        else:
            check_answer(call, await exchange.body())
    finally:
        exchange.close()


async def _check_stream(exchange: Exchange, call: Call) -> None:
    pieces, finish, usage, events, done = [], None, None, 0, False
    buffer = b""
    async for data in exchange.chunks():
        payloads, buffer = split_events(buffer + data)
        for payload in payloads:
            if done:
                raise Failure("bad_response", f"an event after [DONE]: {payload[:200]!r}")
            if payload == "[DONE]":
                done = True
                continue
            event = _json(payload.encode())
            if "error" in event:
                raise Failure("error_event", payload[:300])
            usage = event.get("usage") or usage
            for choice in event.get("choices") or ():
                pieces.append(_choice_text(choice, chat=call.path.endswith("chat/completions"), delta=True))
                finish = choice.get("finish_reason") or finish
            events += 1
            if call.abort_after is not None and events >= call.abort_after:
                return  # the caller closes the connection mid-stream
    if not done:
        raise Failure("cut", f"the stream ended without [DONE] after {events} events")
    check_generation(call, "".join(pieces), finish, usage)


def check_answer(call: Call, raw: bytes) -> None:
    """A whole (not streamed) answer's shape; Failure("bad_response") if it is wrong."""
    if call.kind == "metrics":
        if b"vllm:num_requests_running" not in raw:
            raise Failure("bad_response", f"/metrics lacks vllm:num_requests_running: {raw[:200]!r}")
        return
    answer = _json(raw)
    match call.kind:
        case "invalid":
            _expect(isinstance((answer.get("error") or {}).get("message"), str), "no error message", raw)
        case "models":
            cards = answer.get("data")
            _expect(isinstance(cards, list) and cards and all(isinstance(c.get("id"), str) for c in cards),
                    "no model cards", raw)
        case "tokenize":
            tokens = answer.get("tokens")
            _expect(isinstance(tokens, list) and tokens and answer.get("count") == len(tokens), "bad tokens", raw)
        case "detokenize":
            _expect(isinstance(answer.get("prompt"), str), "no prompt text", raw)
        case _:
            choices = answer.get("choices")
            _expect(isinstance(choices, list) and len(choices) == 1, "not one choice", raw)
            text = _choice_text(choices[0], chat=call.path.endswith("chat/completions"), delta=False)
            check_generation(call, text, choices[0].get("finish_reason"), answer.get("usage"))


def check_generation(call: Call, text: str, finish: str | None, usage: dict | None) -> None:
    """A finished generation's text, finish reason and usage against what `call` asked."""
    if finish not in ("stop", "length"):
        raise Failure("bad_response", f"finish_reason {finish!r}")
    tokens = (usage or {}).get("completion_tokens")
    if not isinstance(tokens, int) or not 0 <= tokens <= call.max_tokens:
        raise Failure("bad_response", f"usage {usage} for max_tokens {call.max_tokens}")
    if call.exact_tokens and tokens != call.max_tokens:
        raise Failure("bad_response", f"{tokens} completion tokens with ignore_eos, not {call.max_tokens}")
    if any(stop in text for stop in call.stop):
        raise Failure("bad_response", f"the text holds a stop string of {call.stop}: {text[-200:]!r}")


def _choice_text(choice: dict, chat: bool, delta: bool) -> str:
    if not chat:
        text = choice.get("text")
    else:
        text = (choice.get("delta" if delta else "message") or {}).get("content")
    if text is not None and not isinstance(text, str):
        raise Failure("bad_response", f"a choice's text is not a string: {choice}")
    return text or ""


def _json(raw: bytes) -> dict:
    try:
        value = json.loads(raw)
    except ValueError:
        raise Failure("bad_response", f"not JSON: {raw[:200]!r}") from None
    if not isinstance(value, dict):
        raise Failure("bad_response", f"not a JSON object: {raw[:200]!r}")
    return value


def _expect(condition: bool, message: str, raw: bytes) -> None:
    if not condition:
        raise Failure("bad_response", f"{message}: {raw[:200]!r}")
