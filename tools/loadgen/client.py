"""One streamed request, timed token by token; every failure becomes a record, never an exception.

Times are taken with `time.perf_counter()` around the HTTP exchange: TTFT is the first chunk
that carries text (answer or reasoning), inter-token latencies are the gaps between later
such chunks, and the end is the `data: [DONE]` event. Token counts come from the server's
`usage` (asked for with `stream_options.include_usage`), else from the number of chunks.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx

from .workloads import Conversation

ERROR_KINDS = ("connect", "http_4xx", "http_5xx", "stream_error", "stream_cut", "timeout", "bad_response")


@dataclass(slots=True)
class RequestOptions:
    """What every request carries besides its prompt."""

    endpoint: str  # "chat" or "completions"
    model: str | None
    ignore_eos: bool = True
    temperature: float = 0.0
    timeout_s: float = 600.0
    response_format: dict | None = None  # OpenAI's field, sent as given (e.g. a json_schema)


@dataclass(slots=True)
class RequestRecord:
    """Everything measured about one request; times in seconds, `start_s` from the run's start."""

    index: int
    conversation: int
    turn: int
    start_s: float
    expected_prompt_tokens: int
    expected_output_tokens: int
    ok: bool = False
    error_kind: str | None = None
    error: str | None = None
    status: int | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    cached_tokens: int | None = None
    reasoning_tokens: int | None = None
    num_chunks: int = 0
    usage_reported: bool = False

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first."""
        if not self.ok or self.ttft_s is None or self.e2e_s is None or not self.output_tokens:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1) if self.output_tokens > 1 else None


def request_body(conversation: Conversation, turn: int, options: RequestOptions) -> tuple[str, dict]:
    """The path and JSON body of a conversation's turn, with the history the server has answered."""
    current = conversation.turns[turn]
    body: dict = {"max_tokens": current.output_len, "temperature": options.temperature, "stream": True,
                  "stream_options": {"include_usage": True}}
    if options.model is not None:
        body["model"] = options.model
    if options.ignore_eos:
        body["ignore_eos"] = True
        body["min_tokens"] = current.output_len
    if conversation.thinking_budget is not None:
        body["thinking_budget"] = conversation.thinking_budget
    if options.response_format is not None:
        body["response_format"] = options.response_format
    if options.endpoint == "chat":
        messages = [{"role": "system", "content": conversation.system.text}] if conversation.system else []
        for past, reply in zip(conversation.turns[:turn], conversation.replies):
            messages += [{"role": "user", "content": past.user.text}, {"role": "assistant", "content": reply}]
        messages.append({"role": "user", "content": current.user.text})
        body["messages"] = messages
        return "/v1/chat/completions", body
    body["prompt"] = _completion_prompt(conversation, turn)
    return "/v1/completions", body


def _completion_prompt(conversation: Conversation, turn: int) -> str | list[int]:
    segments = ([conversation.system] if conversation.system else []) + [t.user for t in conversation.turns[:turn + 1]]
    if turn == 0 and all(s.token_ids is not None for s in segments):
        return [token for s in segments for token in s.token_ids]
    parts = [conversation.system.text] if conversation.system else []
    for past, reply in zip(conversation.turns[:turn], conversation.replies):
        parts += [past.user.text, reply]
    parts.append(conversation.turns[turn].user.text)
    return "\n\n".join(parts)


class _StreamFailed(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


async def send(http: httpx.AsyncClient, path: str, body: dict, record: RequestRecord,
               timeout_s: float) -> str:
    """Stream one request into `record`; returns the text received (the reply, so far as it came)."""
    pieces: list[str] = []
    start = time.perf_counter()
    try:
        await asyncio.wait_for(_stream(http, path, body, record, pieces, start), timeout_s)
        record.ok = True
    except _StreamFailed as exc:
        record.error_kind, record.error = exc.kind, str(exc)
    except (asyncio.TimeoutError, httpx.TimeoutException) as exc:
        record.error_kind, record.error = "timeout", f"no answer within the timeout ({type(exc).__name__})"
    except (httpx.ConnectError, httpx.UnsupportedProtocol) as exc:
        record.error_kind, record.error = "connect", f"{type(exc).__name__}: {exc}"
    except httpx.HTTPError as exc:  # the connection dropped or the framing broke mid-stream
        record.error_kind, record.error = "stream_cut", f"{type(exc).__name__}: {exc}"
    record.e2e_s = time.perf_counter() - start
    if record.output_tokens is None and record.ok:
        record.output_tokens = record.num_chunks
    return "".join(pieces)


async def _stream(http: httpx.AsyncClient, path: str, body: dict, record: RequestRecord,
                  pieces: list[str], start: float) -> None:
    async with http.stream("POST", path, json=body) as response:
        record.status = response.status_code
        if response.status_code != 200:
            raw = await response.aread()
            kind = {4: "http_4xx", 5: "http_5xx"}.get(response.status_code // 100, "bad_response")  # 3xx: not followed
            raise _StreamFailed(kind, f"HTTP {response.status_code}: {_error_message(raw)}")
        last = None
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                return
            now = time.perf_counter()
            try:
                text = _absorb(payload, record)
            except (AttributeError, TypeError, ValueError) as exc:  # an event of the wrong shape
                raise _StreamFailed("bad_response", f"malformed event ({exc}): {payload[:200]!r}") from None
            if text:
                pieces.append(text)
                record.num_chunks += 1
                if last is None:
                    record.ttft_s = now - start
                else:
                    record.itl_s.append(now - last)
                last = now
        raise _StreamFailed("stream_cut", f"the stream ended without [DONE] after {record.num_chunks} chunks")


def _absorb(payload: str, record: RequestRecord) -> str:
    """Fold one SSE event into the record; returns the text it carried."""
    try:
        event = json.loads(payload)
    except json.JSONDecodeError:
        raise _StreamFailed("bad_response", f"an event is not JSON: {payload[:200]!r}") from None
    if not isinstance(event, dict):
        raise _StreamFailed("bad_response", f"an event is not a JSON object: {payload[:200]!r}")
    if "error" in event:
        raise _StreamFailed("stream_error", f"error event: {_error_message(payload.encode())}")
    usage = event.get("usage")
    if usage:
        record.usage_reported = True
        record.prompt_tokens = usage.get("prompt_tokens")
        record.output_tokens = usage.get("completion_tokens")
        record.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        record.reasoning_tokens = (usage.get("completion_tokens_details") or {}).get("reasoning_tokens")
    text = []
    for choice in event.get("choices") or ():
        delta = choice.get("delta")
        if delta is not None:
            text += [delta.get(k) or "" for k in ("reasoning_content", "reasoning", "content")]
        else:
            text.append(choice.get("text") or "")
    return "".join(text)


def _error_message(raw: bytes) -> str:
    try:
        error = json.loads(raw)["error"]
        return str(error.get("message", error)) if isinstance(error, dict) else str(error)
    except (ValueError, KeyError, TypeError):
        return raw[:300].decode("utf-8", "replace") or "(empty body)"
