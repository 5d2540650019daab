"""Generations as OpenAI answers: whole JSON bodies, or SSE chunks with `data: [DONE]` last.

`GenerationResponse` is the ASGI response for both. It watches the connection while the
answer is produced: a client that goes away cancels the producer, and the generation's
remaining samples are aborted in the worker before the handler returns.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import msgspec
from starlette.responses import Response

from spillway.gateway.api import answers
from spillway.gateway.api import openai as api
from spillway.gateway.link.client import WorkerLost, WorkerTimeout
from spillway.gateway.api.logprob_answers import (
    TokenStrings,
    chat_logprobs,
    completion_logprobs,
    prompt_logprobs,
    token_id_string,
)
from spillway.gateway.generation.serving import Generation, Sample
from spillway.gateway.generation.tool_answers import ToolCallStream, tool_finish_reason, whole_tool_calls
from spillway.gateway.text.tool_calls.calls import ToolCallDelta
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


NO_TOKENIZER_NOTICE = ("this server has no tokenizer for its model: the text is empty, the tokens are in "
                       "choices[].token_ids")


@dataclass(frozen=True, slots=True)
class Shape:
    """What an answer carries beyond the text, from the job and the server."""

    strings: TokenStrings | Callable[[int], tuple[str, list[int]]]  # logprob token names
    token_ids: bool  # the prompt's and each choice's token ids
    notice: str | None  # why the text is empty

    @classmethod
    def of(cls, job, strings: TokenStrings) -> Shape:
        no_tokenizer = strings.tokenizer is None
        return cls(token_id_string if job.tokens_as_ids else strings, job.return_token_ids or no_tokenizer,
                   NO_TOKENIZER_NOTICE if no_tokenizer else None)


def _ids(shape: Shape, token_ids: list[int]) -> list[int] | msgspec.UnsetType:
    return list(token_ids) if shape.token_ids else msgspec.UNSET


def _prompt_logprobs(sample: Sample, shape: Shape) -> answers.PromptLogprobs | msgspec.UnsetType:
    return msgspec.UNSET if sample.prompt_logprobs is None else prompt_logprobs(sample.prompt_logprobs, shape.strings)


async def chat_events(gen: Generation, strings: TokenStrings) -> AsyncIterator[bytes]:
    """The chat stream's SSE events, those of one batch of updates joined (see `_stream`)."""
    job, shape = gen.job, Shape.of(gen.job, strings)
    want_logprobs = job.params.logprobs is not None

    def chunk(choice: answers.ChatChunkChoice | None, prompt_token_ids: list[int] | None = None) -> bytes:
        usage = gen.usage() if job.continuous_usage or choice is None else None
        return sse(answers.ChatCompletionChunk(id=job.answer_id, object="chat.completion.chunk", created=job.created,
                                               model=job.model, choices=[choice] if choice else [], usage=usage,
                                               prompt_token_ids=prompt_token_ids))

    prompt_ids = list(job.prompts[0].token_ids) if shape.token_ids else None
    yield b"".join(chunk(answers.ChatChunkChoice(sample.index, answers.ChatDelta(role="assistant", content="")),
                         prompt_ids if sample.index == 0 else None) for sample in gen.samples)
    # With tools, each choice's content goes through its tool-call stream: text and call deltas.
    tool_streams = [ToolCallStream(job.tool_use, job.tool_parser) for _ in gen.samples] if job.tool_use else None
    async for updates in gen.updates():
        events = []
        for update in updates:
            logprobs = chat_logprobs(update.logprobs, shape.strings) if want_logprobs and update.logprobs else None
            token_ids = _ids(shape, update.token_ids)
            text, calls = update.text, None
            if tool_streams is not None:
                stream = tool_streams[update.sample.index]
                text, deltas = stream.feed(update.text)
                if update.finished:
                    rest, more = stream.finish()
                    text, deltas = text + rest, deltas + more
                calls = [_call_chunk(delta) for delta in deltas] or None
            if update.reasoning_text:
                thought = update.reasoning_text
                events.append(chunk(answers.ChatChunkChoice(update.sample.index,
                                                            answers.ChatDelta(reasoning_content=thought,
                                                                              reasoning=thought),
                                                            logprobs, token_ids=token_ids)))
                logprobs, token_ids = None, msgspec.UNSET  # sent with the reasoning
                if text or calls:
                    events.append(chunk(answers.ChatChunkChoice(update.sample.index,
                                                                answers.ChatDelta(content=text or None,
                                                                                  tool_calls=calls))))
            elif text or calls or logprobs is not None or update.token_ids and shape.token_ids:
                content = text if text or not calls else None
                events.append(chunk(answers.ChatChunkChoice(update.sample.index,
                                                            answers.ChatDelta(content=content, tool_calls=calls),
                                                            logprobs, token_ids=token_ids)))
            if update.finished:
                sample = update.sample
                reason = sample.finish_reason
                if tool_streams is not None:
                    reason = tool_streams[sample.index].finish_reason(reason)
                events.append(chunk(answers.ChatChunkChoice(sample.index, answers.ChatDelta(), None,
                                                            reason, sample.stop_reason)))
        if gen.finished and job.include_usage:
            events.append(chunk(None))
        if events:
            yield b"".join(events)


async def completion_events(gen: Generation, strings: TokenStrings) -> AsyncIterator[bytes]:
    """The completion stream's SSE events, those of one batch of updates joined (see `_stream`)."""
    job, shape = gen.job, Shape.of(gen.job, strings)
    want_logprobs = job.params.logprobs is not None
    offsets = [0] * len(gen.samples)
    started = [False] * len(gen.samples)

    def chunk(choice: answers.CompletionChoice | None) -> bytes:
        usage = gen.usage() if job.continuous_usage or choice is None else None
        return sse(answers.Completion(id=job.answer_id, object="text_completion", created=job.created,
                                      model=job.model, choices=[choice] if choice else [], usage=usage,
                                      notice=shape.notice))

    async for updates in gen.updates():
        events = []
        for update in updates:
            sample = update.sample
            index = sample.index
            logprobs = None
            if want_logprobs and update.logprobs:
                logprobs = completion_logprobs(update.logprobs, shape.strings, offsets[index])
                offsets[index] += sum(len(t) for t in logprobs.tokens)
            if update.text or logprobs is not None or update.token_ids and shape.token_ids:
                choice = answers.CompletionChoice(index, update.text, logprobs, token_ids=_ids(shape, update.token_ids))
                if not started[index]:  # the prompt's token ids come with a choice's first chunk
                    choice.prompt_token_ids = _ids(shape, job.prompts[sample.prompt_index].token_ids)
                    started[index] = True
                events.append(chunk(choice))
            if update.finished:
                events.append(chunk(answers.CompletionChoice(index, "", None, sample.finish_reason,
                                                             sample.stop_reason)))
        if gen.finished and job.include_usage:
            events.append(chunk(None))
        if events:
            yield b"".join(events)


async def whole_response(gen: Generation, strings: TokenStrings):
    job, shape = gen.job, Shape.of(gen.job, strings)
    want_logprobs = job.params.logprobs is not None
    entries: list[list[TokenLogprobs]] = [[] for _ in gen.samples]
    async for updates in gen.updates():
        if want_logprobs:
            for update in updates:
                entries[update.sample.index].extend(update.logprobs)
    if job.chat:
        choices = []
        for s in gen.samples:
            message, reason = _assistant_message(s), s.finish_reason
            if job.tool_use is not None:
                content, calls = whole_tool_calls(job.tool_use, job.tool_parser, message.content)
                message.content = content
                message.tool_calls = [answers.ToolCallAnswer(call.id, answers.FunctionCall(call.name, call.arguments))
                                      for call in calls]
                reason = tool_finish_reason(job.tool_use, len(calls), reason)
            choices.append(answers.ChatChoice(s.index, message,
                                              chat_logprobs(entries[s.index], shape.strings) if want_logprobs else None,
                                              reason, s.stop_reason, _ids(shape, s.token_ids)))
        return answers.ChatCompletion(id=job.answer_id, created=job.created, model=job.model, choices=choices,
                                      usage=gen.usage(), prompt_token_ids=_ids(shape, job.prompts[0].token_ids),
                                      prompt_logprobs=_prompt_logprobs(gen.samples[0], shape),
                                      notice=shape.notice or msgspec.UNSET,
                                      kv_transfer_params=_kv_transfer_params(job) or msgspec.UNSET)
    choices = [answers.CompletionChoice(
        s.index, s.output.text,
        completion_logprobs(entries[s.index], shape.strings, 0) if want_logprobs else None,
        s.finish_reason, s.stop_reason, _ids(shape, job.prompts[s.prompt_index].token_ids), _ids(shape, s.token_ids),
        _prompt_logprobs(s, shape)) for s in gen.samples]
    return answers.Completion(id=job.answer_id, object="text_completion", created=job.created, model=job.model,
                              choices=choices, usage=gen.usage(), notice=shape.notice,
                              kv_transfer_params=_kv_transfer_params(job))


def _kv_transfer_params(job) -> dict | None:
    """A prefill server's answer names its KV server (the two-server form); vLLM's proxy sends
    whole requests there, so stream chunks carry none."""
    return job.kv_transfer.answer_params() if job.kv_transfer is not None else None


def _call_chunk(delta: ToolCallDelta) -> answers.ToolCallChunk:
    if delta.id is not None:  # a call's first piece: its id, type and name
        return answers.ToolCallChunk(delta.index, delta.id, "function", answers.FunctionDelta(delta.name,
                                                                                               delta.arguments))
    return answers.ToolCallChunk(delta.index, function=answers.FunctionDelta(arguments=delta.arguments))


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
        """One write per batch of updates, not per event: each write is a system call and, at a
        few tokens per request, most of a stream's cost. The last batch carries the stream's
        end ([DONE] and the chunked body's terminator) with it. A constrained answer's status
        waits for its grammar: a schema the grammar library refuses is a 400, as unstreamed."""
        if self.generation.job.params.structured_outputs is not None:
            try:
                await self.generation.accepted()
            except api.ApiError as exc:
                await error_response(exc)({"type": "http"}, _no_receive, send)
                return
            except WorkerLost as exc:
                await error_response(worker_lost_error(exc))({"type": "http"}, _no_receive, send)
                return
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        events = chat_events if self.generation.job.chat else completion_events
        end = DONE
        try:
            async for batch in events(self.generation, self.strings):
                if self.generation.finished:
                    end = batch + DONE
                else:
                    await send({"type": "http.response.body", "body": batch, "more_body": True})
        except api.ApiError as exc:
            await send({"type": "http.response.body", "body": sse(exc.body()), "more_body": True})
        except WorkerLost as exc:
            body = sse(worker_lost_error(exc).body())
            await send({"type": "http.response.body", "body": body, "more_body": True})
        except Exception as exc:
            logger.exception("streaming %s failed", self.generation.job.request_id)
            error = api.ApiError(500, f"internal error: {exc}", type="server_error")
            await send({"type": "http.response.body", "body": sse(error.body()), "more_body": True})
        await send({"type": "http.response.body", "body": end, "more_body": False})


async def _wait_for_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _no_receive():
    raise RuntimeError("a finished request has nothing more to receive")
