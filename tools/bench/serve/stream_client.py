"""The streaming client of tools/bench/serve/serve.py: token-id prompts on /v1/completions, each
request's server-sent events timed as they arrive.

`StreamTiming` is the parser: fed `(arrival time, raw event payload)`, it keeps the time to the
first token, the gap before every later event that carried tokens, and how many tokens each
such event carried. Token counts come from `usage.completion_tokens` on every chunk (the request
asks for `continuous_usage_stats`): a chunk's tokens are the growth of that count. A server that
sends usage only at the end gets one token per text-carrying event, and `tokens_exact` is False.

`send_request` and `Exchange` are the HTTP underneath, for any route (tools/soak/served.py sends its
whole traffic mix through them).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit


class StreamError(Exception):
    """The server answered with an error, an error event, or a stream cut short."""


@dataclass(slots=True)
class StreamTiming:
    """One request's events; times in seconds of `time.perf_counter()`."""

    start: float
    first_token_at: float | None = None
    last_token_at: float | None = None
    gaps: list[float] = field(default_factory=list)  # before each token-carrying event after the first
    event_tokens: list[int] = field(default_factory=list)  # tokens of each token-carrying event
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    tokens_exact: bool = True
    done: bool = False

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.start

    @property
    def counted_tokens(self) -> int:
        return sum(self.event_tokens)

    def feed(self, now: float, payload: str) -> None:
        """Fold one event's `data:` payload (without the prefix) into the timing."""
        if self.done:
            raise StreamError(f"an event after [DONE]: {payload[:200]!r}")
        if payload == "[DONE]":
            self.done = True
            return
        try:
            event = json.loads(payload)
        except json.JSONDecodeError:
            raise StreamError(f"an event is not JSON: {payload[:200]!r}") from None
        if not isinstance(event, dict):
            raise StreamError(f"an event is not a JSON object: {payload[:200]!r}")
        if "error" in event:
            raise StreamError(f"error event: {payload[:300]}")
        choices = event.get("choices") or []
        usage = event.get("usage")
        tokens = 0
        if usage:
            completion = usage.get("completion_tokens") or 0
            if choices:
                tokens = completion - self.counted_tokens
            self.prompt_tokens = usage.get("prompt_tokens")
            self.completion_tokens = completion
            self.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        elif any(choice.get("text") for choice in choices):
            tokens, self.tokens_exact = 1, False  # no usage on this chunk: a count cannot be known
        if tokens <= 0:
            return
        if self.first_token_at is None:
            self.first_token_at = now
        else:
            self.gaps.append(now - self.last_token_at)
        self.last_token_at = now
        self.event_tokens.append(tokens)

    def check(self, expected_tokens: int) -> None:
        """StreamError unless the stream ended with [DONE] and carried `expected_tokens`."""
        if not self.done:
            raise StreamError(f"the stream ended without [DONE] after {len(self.event_tokens)} token events")
        if self.completion_tokens != expected_tokens:
            raise StreamError(f"usage reports {self.completion_tokens} completion tokens, not {expected_tokens}")
        if self.tokens_exact and self.counted_tokens != expected_tokens:
            raise StreamError(f"the events carried {self.counted_tokens} tokens, usage says {expected_tokens}")


def split_events(buffer: bytes) -> tuple[list[str], bytes]:
    """Complete SSE events of `buffer` as their `data:` payloads, and the incomplete rest."""
    payloads = []
    *complete, rest = buffer.replace(b"\r\n", b"\n").split(b"\n\n")
    for event in complete:
        for line in event.split(b"\n"):
            if line.startswith(b"data:"):
                payloads.append(line[5:].strip().decode())
    return payloads, rest


def completion_body(prompt: list[int], max_tokens: int, model: str) -> dict:
    """A greedy streamed completion of exactly `max_tokens` tokens, usage on every chunk."""
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}


def encode_body(prompt: list[int], max_tokens: int, model: str) -> bytes:
    return json.dumps(completion_body(prompt, max_tokens, model)).encode()


@dataclass(slots=True)
class Exchange:
    """One request's connection once the response's head has arrived."""

    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    status: int
    headers: dict[str, str]  # names in lower case

    async def chunks(self):
        """The chunked body's chunks, as they arrive; ValueError if the body is not chunked."""
        if self.headers.get("transfer-encoding") != "chunked":
            raise ValueError(f"the body is not chunked: {self.headers}")
        while size := int((await self.reader.readuntil(b"\r\n")).split(b";", 1)[0], 16):
            yield (await self.reader.readexactly(size + 2))[:-2]  # the chunk less its CRLF

    async def body(self) -> bytes:
        """The whole body: by its Content-Length, its chunks, or up to the close."""
        if "content-length" in self.headers:
            return await self.reader.readexactly(int(self.headers["content-length"]))
        if self.headers.get("transfer-encoding") == "chunked":
            return b"".join([chunk async for chunk in self.chunks()])
        return await self.reader.read()

    def close(self) -> None:
        self.writer.close()


Connection = tuple[asyncio.StreamReader, asyncio.StreamWriter]


async def open_connection(url: str) -> Connection:
    parts = urlsplit(url)
    return await asyncio.open_connection(parts.hostname, parts.port)


async def send_request(url: str, method: str, path: str, body: bytes | None = None,
                       connection: Connection | None = None) -> Exchange:
    """Send one request on a connection of its own (`Connection: close`, see `stream_completion`;
    `connection`: one opened beforehand, else a new one) and read the response's head. The
    caller closes the exchange."""
    parts = urlsplit(url)
    head = f"{method} {path} HTTP/1.1\r\nHost: {parts.netloc}\r\nConnection: close\r\n"
    if body is not None:
        head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    reader, writer = connection or await open_connection(url)
    try:
        writer.write((head + "\r\n").encode() + (body or b""))
        status_line, *header_lines = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        headers = dict(line.lower().split(": ", 1) for line in header_lines if line)
        return Exchange(reader, writer, int(status_line.split(" ", 2)[1]), headers)
    except BaseException:
        writer.close()
        raise


async def stream_completion(url: str, prompt: list[int], max_tokens: int, model: str,
                            body: bytes | None = None, connection: Connection | None = None) -> StreamTiming:
    """Send one request and time its events; StreamError for anything but a full answer.
    `body`: the request's JSON, encoded beforehand; `connection`: opened beforehand, the clock
    then starts at the send (see `stream_all`).

    Plain HTTP/1.1 over asyncio streams, one connection per request (`Connection: close`): a
    pooled client's bookkeeping grows with the streams open at once (httpx/httpcore walk every
    connection on each request and each close, O(n^2) over a burst: at 256 streams it kept
    this process busy for seconds after the server had sent the last token).
    """
    body = body or encode_body(prompt, max_tokens, model)
    timing = StreamTiming(start=time.perf_counter())
    try:
        exchange = await send_request(url, "POST", "/v1/completions", body, connection)
    except (asyncio.IncompleteReadError, ValueError) as exc:
        raise StreamError(f"the response broke off: {exc}") from None
    try:
        if exchange.status != 200:
            raise StreamError(f"HTTP {exchange.status}: {(await exchange.reader.read(300))!r}")
        buffer = b""
        async for data in exchange.chunks():
            now = time.perf_counter()
            payloads, buffer = split_events(buffer + data)
            for payload in payloads:
                timing.feed(now, payload)
    except (asyncio.IncompleteReadError, ValueError) as exc:
        raise StreamError(f"the response broke off: {exc}") from None
    finally:
        exchange.close()
    timing.check(max_tokens)
    return timing


async def stream_all(url: str, prompts: list[list[int]], max_tokens: int, model: str,
                     preconnect: bool = False) -> tuple[list[StreamTiming], float]:
    """Every prompt sent at once; the timings and the wall seconds from the first send to the last end.

    The bodies are encoded first: encoded by each request as it starts, a burst of long prompts
    (~1 ms of JSON each for 10k ids) would hold every send behind all the encodings while the
    first requests' clocks already run. `preconnect`: the connections are opened first too, and
    each clock starts at its request's send: opened by each request as it starts, this one
    process's connects come first (~0.2-0.4 ms of its event loop each on a 2-core machine: a
    50-request burst's first request was sent 11-19 ms after its clock started), where the
    users of a real burst connect each on their own."""
    bodies = [encode_body(p, max_tokens, model) for p in prompts]
    connections = [None] * len(prompts)
    if preconnect:
        connections = await asyncio.gather(*(open_connection(url) for _ in prompts))
    started = time.perf_counter()
    timings = await asyncio.gather(*(stream_completion(url, p, max_tokens, model, body, connection)
                                     for p, body, connection in zip(prompts, bodies, connections)))
    return list(timings), time.perf_counter() - started


async def stream_each(url: str, prompts: list[list[int]], max_tokens: int, model: str) -> list[StreamTiming]:
    """One prompt after another, each on an idle server."""
    return [await stream_completion(url, p, max_tokens, model) for p in prompts]


def stream_all_processes(url: str, prompts: list[list[int]], max_tokens: int, model: str, processes: int,
                         preconnect: bool = False, timeout: float = 120.0) -> list[StreamTiming]:
    """`stream_all` split over `processes` client processes (prompt i goes to process i %
    processes), every one sending at the same instant: the timings, in the prompts' order.

    One client process reads a burst's answers one at a time on its event loop: when 50 first
    tokens come out together, the last is read (and its clock stopped) after the other 49, so
    the burst's TTFT percentiles hold this process's own queue. The users of a real burst each
    read on their own; a few processes, each with its share of the streams, shorten that queue,
    and the two figures side by side say how much of a burst's TTFT the client was.
    The processes are started and connected (`preconnect`) before a shared start time on the
    system's monotonic clock (perf_counter's, the same in every process)."""
    import multiprocessing

    if processes < 1:
        raise ValueError(f"the client needs at least one process, got {processes}")
    context = multiprocessing.get_context("spawn")
    links, children = [], []
    try:
        for index in range(processes):
            bodies = [encode_body(prompt, max_tokens, model) for prompt in prompts[index::processes]]
            parent, child = context.Pipe()
            process = context.Process(target=_client_process, args=(child, url, bodies, max_tokens, preconnect),
                                      daemon=True)
            process.start()
            links.append(parent)
            children.append(process)
        for link in links:
            _expect(link, timeout, "ready")
        start_at = time.perf_counter() + 0.02
        for link in links:
            link.send(start_at)
        shares = [_expect(link, timeout, "timings") for link in links]
    finally:
        for process in children:
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
    timings: list[StreamTiming | None] = [None] * len(prompts)
    for index, share in enumerate(shares):
        timings[index::processes] = share
    return timings


def _expect(link, timeout: float, what: str):
    if not link.poll(timeout):
        raise StreamError(f"a client process sent no {what} within {timeout:g} s")
    kind, value = link.recv()
    if kind == "error":
        raise StreamError(f"a client process failed: {value}")
    return value


def _client_process(link, url: str, bodies: list[bytes], max_tokens: int, preconnect: bool) -> None:
    """One process of `stream_all_processes`: connect, say ready, wait for the start time, send."""
    async def run() -> list[StreamTiming]:
        connections = [None] * len(bodies)
        if preconnect:
            connections = await asyncio.gather(*(open_connection(url) for _ in bodies))
        link.send(("ready", None))
        start_at = link.recv()
        while time.perf_counter() < start_at:  # a few milliseconds at most: spin, do not sleep past it
            pass
        return await asyncio.gather(*(stream_completion(url, [], max_tokens, "", body, connection)
                                      for body, connection in zip(bodies, connections)))

    try:
        link.send(("timings", asyncio.run(run())))
    except Exception as exc:  # the parent reports it
        link.send(("error", f"{type(exc).__name__}: {exc}"))
