"""Generations as OpenAI answers: whole JSON bodies, or SSE chunks with `data: [DONE]` last.

`GenerationResponse` is the ASGI response for both. It watches the connection while the
answer is produced: a client that goes away cancels the producer, and the generation's
remaining samples are aborted in the worker before the handler returns.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import msgspec
from starlette.responses import Response

from spillway.gateway import answers
from spillway.gateway import openai as api
from spillway.gateway.client import WorkerLost, WorkerTimeout
from spillway.gateway.serving import Generation, Sample
from spillway.protocol.messages import TokenLogprobs

logger = logging.getLogger("spillway.gateway")

DONE = b"data: [DONE]\n\n"
SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
               (b"x-accel-buffering", b"no")]
_encoder = msgspec.json.Encoder()


def json_response(body, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(_encoder.encode(body), status, headers, media_type="application/json")


def error_response(error: api.ApiError) -> Response:
    headers = {"Retry-After": str(error.retry_after)} if error.retry_after is not None else None
    return json_response(error.body(), error.status, headers)


def worker_lost_error(exc: WorkerLost) -> api.ApiError:
    if isinstance(exc, WorkerTimeout):
        return api.ApiError(504, f"the request timed out: {exc}", type="server_error", code="worker_timeout")
    return api.ApiError(503, f"the request failed because the engine stopped: {exc}", type="server_error",
                        code="engine_unavailable", retry_after=5)


def sse(body) -> bytes:
    return b"data: " + _encoder.encode(body) + b"\n\n"


class TokenStrings:
    """Token id -> its text and its bytes, for logprobs."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._byte_level = backend is not None and type(backend.decoder).__name__ == "ByteLevel"
        self._byte_table = _byte_level_table() if self._byte_level else {}
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        entry = self._cache.get(token_id)
        if entry is None:
            if self._tokenizer is None:
                entry = (f"token_id:{token_id}", [])
            else:
                text = self._tokenizer.decode([token_id], skip_special_tokens=False)
                raw = self._tokenizer.convert_ids_to_tokens(token_id) if self._byte_level else None
                if raw is not None and all(ch in self._byte_table for ch in raw):
                    entry = (text, [self._byte_table[ch] for ch in raw])
                else:
                    entry = (text, list(text.encode()))
            self._cache[token_id] = entry
        return entry


def _byte_level_table() -> dict[str, int]:
    """Byte-level BPE spells each byte as one printable character; this maps them back."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in printable}
    shifted = 0
    for b in range(256):
        if b not in table.values():
            table[chr(256 + shifted)] = b
            shifted += 1
    return table


def chat_logprobs(entries: list[TokenLogprobs], strings: TokenStrings) -> answers.ChatLogprobs:
    content = []
    for entry in entries:
        text, raw = strings(entry.token_id)
        top = []
        for token_id, logprob in zip(entry.top_token_ids, entry.top_logprobs):
            top_text, top_raw = strings(token_id)
            top.append(answers.TopLogprob(top_text, logprob, top_raw))
        content.append(answers.ChatTokenLogprob(text, entry.logprob, raw, top))
    return answers.ChatLogprobs(content)


def completion_logprobs(entries: list[TokenLogprobs], strings: TokenStrings, offset: int) -> answers.CompletionLogprobs:
    result = answers.CompletionLogprobs([], [], [], [])
    for entry in entries:
        text = strings(entry.token_id)[0]
        top = {strings(tid)[0]: lp for tid, lp in zip(entry.top_token_ids, entry.top_logprobs)}
        top.setdefault(text, entry.logprob)
        result.text_offset.append(offset)
        result.token_logprobs.append(entry.logprob)
        result.tokens.append(text)
        result.top_logprobs.append(top)
        offset += len(text)
    return result


async def chat_events(gen: Generation, strings: TokenStrings) -> AsyncIterator[bytes]:
    job = gen.job
    want_logprobs = job.params.logprobs is not None

    def chunk(choice: answers.ChatChunkChoice | None) -> bytes:
        usage = gen.usage() if job.continuous_usage or choice is None else None
        return sse(answers.ChatCompletionChunk(id=job.request_id, object="chat.completion.chunk", created=job.created,
                                           model=job.model, choices=[choice] if choice else [], usage=usage))

    for sample in gen.samples:
        yield chunk(answers.ChatChunkChoice(sample.index, answers.ChatDelta(role="assistant", content="")))
    async for updates in gen.updates():
        for update in updates:
            logprobs = chat_logprobs(update.logprobs, strings) if want_logprobs and update.logprobs else None
            if update.reasoning_text:
                thought = update.reasoning_text
                yield chunk(answers.ChatChunkChoice(update.sample.index,
                                                answers.ChatDelta(reasoning_content=thought, reasoning=thought), logprobs))
                logprobs = None  # sent with the reasoning
                if update.text:
                    yield chunk(answers.ChatChunkChoice(update.sample.index, answers.ChatDelta(content=update.text)))
            elif update.text or logprobs is not None:
                yield chunk(answers.ChatChunkChoice(update.sample.index, answers.ChatDelta(content=update.text), logprobs))
            if update.finished:
                sample = update.sample
                yield chunk(answers.ChatChunkChoice(sample.index, answers.ChatDelta(), None, sample.finish_reason,
                                                sample.stop_reason))
    if job.include_usage:
        yield chunk(None)


async def completion_events(gen: Generation, strings: TokenStrings) -> AsyncIterator[bytes]:
    job = gen.job
    want_logprobs = job.params.logprobs is not None
    offsets = [0] * len(gen.samples)

    def chunk(choice: answers.CompletionChoice | None) -> bytes:
        usage = gen.usage() if job.continuous_usage or choice is None else None
        return sse(answers.Completion(id=job.request_id, object="text_completion", created=job.created,
                                  model=job.model, choices=[choice] if choice else [], usage=usage))

    async for updates in gen.updates():
        for update in updates:
            index = update.sample.index
            logprobs = None
            if want_logprobs and update.logprobs:
                logprobs = completion_logprobs(update.logprobs, strings, offsets[index])
                offsets[index] += sum(len(t) for t in logprobs.tokens)
            if update.text or logprobs is not None:
                yield chunk(answers.CompletionChoice(index, update.text, logprobs))
            if update.finished:
                yield chunk(answers.CompletionChoice(index, "", None, update.sample.finish_reason,
                                                 update.sample.stop_reason))
    if job.include_usage:
        yield chunk(None)


async def whole_response(gen: Generation, strings: TokenStrings):
    job = gen.job
    want_logprobs = job.params.logprobs is not None
    entries: list[list[TokenLogprobs]] = [[] for _ in gen.samples]
    async for updates in gen.updates():
        if want_logprobs:
            for update in updates:
                entries[update.sample.index].extend(update.logprobs)
    if job.chat:
        choices = [answers.ChatChoice(s.index, _assistant_message(s),
                                  chat_logprobs(entries[s.index], strings) if want_logprobs else None,
                                  s.finish_reason, s.stop_reason) for s in gen.samples]
        return answers.ChatCompletion(job.request_id, job.created, job.model, choices, gen.usage())
    choices = [answers.CompletionChoice(s.index, s.output.text,
                                    completion_logprobs(entries[s.index], strings, 0) if want_logprobs else None,
                                    s.finish_reason, s.stop_reason) for s in gen.samples]
    return answers.Completion(id=job.request_id, object="text_completion", created=job.created, model=job.model,
                          choices=choices, usage=gen.usage())


def _assistant_message(sample: Sample) -> answers.AssistantMessage:
    if sample.reasoning is None:
        return answers.AssistantMessage("assistant", sample.output.text)
    thought = sample.reasoning.text or None
    return answers.AssistantMessage("assistant", sample.output.text, reasoning_content=thought, reasoning=thought)


class GenerationResponse:
    """Produces a started Generation's answer, and aborts it if the client disconnects."""

    def __init__(self, generation: Generation, strings: TokenStrings) -> None:
        self.generation = generation
        self.strings = strings

    async def __call__(self, scope, receive, send) -> None:
        produce = self._stream(send) if self.generation.job.stream else self._whole(send)
        producer = asyncio.create_task(produce)
        watcher = asyncio.create_task(_wait_for_disconnect(receive))
        try:
            await asyncio.wait({producer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (producer, watcher):
                task.cancel()
            await asyncio.gather(producer, watcher, return_exceptions=True)
            self.generation.close()
        if not producer.cancelled() and producer.exception() is not None:
            raise producer.exception()  # a bug: the server's error handler answers 500

    async def _whole(self, send) -> None:
        try:
            body = await whole_response(self.generation, self.strings)
            response = json_response(body)
        except api.ApiError as exc:
            response = error_response(exc)
        except WorkerLost as exc:
            response = error_response(worker_lost_error(exc))
        await response({"type": "http"}, _no_receive, send)

    async def _stream(self, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        events = chat_events if self.generation.job.chat else completion_events
        try:
            async for event in events(self.generation, self.strings):
                await send({"type": "http.response.body", "body": event, "more_body": True})
        except api.ApiError as exc:
            await send({"type": "http.response.body", "body": sse(exc.body()), "more_body": True})
        except WorkerLost as exc:
            body = sse(worker_lost_error(exc).body())
            await send({"type": "http.response.body", "body": body, "more_body": True})
        except Exception as exc:
            logger.exception("streaming %s failed", self.generation.job.request_id)
            error = api.ApiError(500, f"internal error: {exc}", type="server_error")
            await send({"type": "http.response.body", "body": sse(error.body()), "more_body": True})
        await send({"type": "http.response.body", "body": DONE, "more_body": False})


async def _wait_for_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _no_receive():
    raise RuntimeError("a finished request has nothing more to receive")
