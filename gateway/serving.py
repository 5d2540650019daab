"""From a validated OpenAI request to worker requests and back to text.

    request ─▶ Job (prompts as token ids, sampling params, limits checked)
            ─▶ Generation.start(): one Generate per (prompt, sample), sent together
            ─▶ Generation.updates(): deltas → detokenized, stop-string-checked text per choice

With a reasoning parser every sample's token ids also run through a ReasoningSplitter; a chat
choice detokenizes its reasoning and its content as two streams (stop strings apply to the
content), and the markers belong to neither.

Choice i of a request with n samples per prompt is sample i % n of prompt i // n.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from spillway.gateway import answers
from spillway.gateway import openai as api
from spillway.gateway.client import EngineClient, RequestStream
from spillway.gateway.detok import OutputText
from spillway.gateway.reasoning import ReasoningMarkers, ReasoningSplitter, thinking_policy
from spillway.gateway.sampling_params import SamplingParams
from spillway.gateway.tokenizer import PromptTokenizer
from spillway.protocol.messages import FinishReason, Generate, Ready, RequestDelta, TokenLogprobs

# Prompts longer than this are tokenized off the event loop.
INLINE_TOKENIZE_CHARS = 16_384
UINT64_MASK = 2**64 - 1


@dataclass(slots=True)
class Prompt:
    token_ids: list[int]
    text: str | None = None


@dataclass(slots=True)
class Job:
    """A checked generation request: everything needed to run it and format its answer."""

    request_id: str
    chat: bool
    model: str
    prompts: list[Prompt]
    params: SamplingParams
    max_tokens: list[int]  # per prompt, after max_model_len
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    priority: int = 0
    cache_salt: str | None = None
    created: int = field(default_factory=lambda: int(time.time()))


@dataclass(slots=True)
class Sample:
    """One choice in flight."""

    index: int
    prompt_index: int
    request_id: str
    output: OutputText  # the content with a reasoning parser (chat), else the whole text
    splitter: ReasoningSplitter | None = None  # with a reasoning parser
    reasoning: OutputText | None = None  # the reasoning text (chat with a reasoning parser)
    num_tokens: int = 0
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass(slots=True)
class Update:
    """What one batch of deltas did to one choice."""

    sample: Sample
    text: str
    logprobs: list[TokenLogprobs]
    reasoning_text: str = ""

    @property
    def finished(self) -> bool:
        return self.sample.finish_reason is not None


class JobBuilder:
    """Checks requests against the model (names, lengths, vocabulary) and tokenizes them."""

    def __init__(self, tokenizer: PromptTokenizer | None, served_names: list[str], ready_fn,
                 reasoning: bool = False) -> None:
        self.tokenizer = tokenizer
        self.served_names = served_names
        self.reasoning = reasoning  # the server has a reasoning parser
        self._ready = ready_fn  # the current worker's Ready (it may have been restarted)

    @property
    def ready(self) -> Ready:
        return self._ready()

    def check_model(self, model: str | None) -> str:
        if model is None or model in self.served_names:
            return self.served_names[0]
        raise api.ApiError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")

    def require_tokenizer(self) -> PromptTokenizer:
        if self.tokenizer is None:
            raise api.bad_request("this model has no tokenizer: send prompts as token ids", code="no_tokenizer")
        return self.tokenizer

    async def chat_job(self, request: api.ChatCompletionRequest) -> Job:
        model = self.check_model(request.model)
        api.check_unsupported(request)
        messages = api.template_messages(request.messages)
        logprobs = api.chat_logprobs(request)
        max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None \
            else request.max_tokens
        params = api.sampling_params(request, max_tokens, logprobs)
        token_ids = await self.encode_chat(messages, request.add_generation_prompt, request.chat_template_kwargs)
        return self._job("chatcmpl", True, model, [Prompt(token_ids)], params, request)

    async def completion_job(self, request: api.CompletionRequest) -> Job:
        model = self.check_model(request.model)
        api.check_unsupported(request)
        params = api.sampling_params(request, 16 if request.max_tokens is None else request.max_tokens,
                                     request.logprobs)
        prompts = []
        for prompt in api.completion_prompts(request.prompt):
            if isinstance(prompt, str):
                prompts.append(Prompt(await self.encode(prompt), prompt))
            else:
                prompts.append(Prompt(list(prompt)))
        return self._job("cmpl", False, model, prompts, params, request)

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        tokenizer = self.require_tokenizer()
        if add_special_tokens:
            encode = tokenizer.encode
        else:
            def encode(t: str) -> list[int]:
                return list(tokenizer.tokenizer(t, add_special_tokens=False)["input_ids"])
        if len(text) > INLINE_TOKENIZE_CHARS:
            return await asyncio.to_thread(encode, text)
        return encode(text)

    async def encode_chat(self, messages: list[dict], add_generation_prompt: bool, kwargs: dict | None) -> list[int]:
        tokenizer = self.require_tokenizer()

        def encode() -> list[int]:
            try:
                return tokenizer.encode_chat(messages, add_generation_prompt=add_generation_prompt,
                                             chat_template_kwargs=kwargs)
            except ValueError as exc:
                raise api.bad_request(str(exc), param="messages") from None
            except TypeError as exc:  # a chat_template_kwargs key the tokenizer rejects
                raise api.bad_request(f"cannot apply the chat template: {exc}",
                                      param="chat_template_kwargs") from None

        if sum(len(m["content"]) for m in messages) > INLINE_TOKENIZE_CHARS:
            return await asyncio.to_thread(encode)
        return encode()

    def _job(self, prefix: str, chat: bool, model: str, prompts: list[Prompt], params: SamplingParams,
             request) -> Job:
        if params.thinking_budget is not None and not self.reasoning:
            raise api.bad_request("thinking_budget needs a reasoning parser: start the server with "
                                  "--enable-reasoning (or --reasoning-parser / --reasoning-config)",
                                  param="thinking_budget")
        max_tokens = [self._check_prompt(p.token_ids, params.max_tokens, "messages" if chat else "prompt")
                      for p in prompts]
        options = request.stream_options
        stream = bool(request.stream)
        return Job(
            request_id=f"{prefix}-{uuid.uuid4().hex}",
            chat=chat,
            model=model,
            prompts=prompts,
            params=params,
            max_tokens=max_tokens,
            stream=stream,
            include_usage=bool(stream and options is not None and options.include_usage),
            continuous_usage=bool(stream and options is not None and options.include_usage
                                  and options.continuous_usage_stats),
            priority=request.priority,
            cache_salt=request.cache_salt,
        )

    def _check_prompt(self, token_ids: list[int], max_tokens: int | None, param: str) -> int:
        """The prompt fits with room for output; returns the resolved max_tokens."""
        ready = self.ready
        limit = ready.max_model_len
        if not token_ids:
            raise api.bad_request("the prompt is empty", param=param)
        if min(token_ids) < 0 or max(token_ids) >= ready.vocab_size:
            raise api.bad_request(f"prompt token ids must lie in [0, {ready.vocab_size})", param=param)
        if len(token_ids) >= limit or (max_tokens is not None and len(token_ids) + max_tokens > limit):
            requested = len(token_ids) + (max_tokens or 1)
            raise api.bad_request(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{requested} tokens ({len(token_ids)} in the prompt, {max_tokens or 1} for the completion). "
                "Please reduce the length of the prompt or the completion.",
                param=param, code="context_length_exceeded")
        return limit - len(token_ids) if max_tokens is None else max_tokens


class Generation:
    """Runs one Job on the worker and turns its deltas into per-choice text updates."""

    def __init__(self, job: Job, client: EngineClient, tokenizer: PromptTokenizer | None,
                 block_hashes, markers: ReasoningMarkers | None = None) -> None:
        self.job = job
        self.markers = markers
        self.client = client
        self.tokenizer = tokenizer
        self._block_hashes = block_hashes
        self.samples: list[Sample] = []
        self._by_id: dict[str, Sample] = {}
        self._stream: RequestStream | None = None
        self._unfinished = 0

    def start(self) -> None:
        """Send every sample to the worker; raises EngineUnavailable / EngineOverloaded."""
        job, params = self.job, self.job.params
        generates = []
        hf_tokenizer = self.tokenizer.tokenizer if self.tokenizer is not None else None
        for prompt_index, prompt in enumerate(job.prompts):
            hashes = self._block_hashes(prompt.token_ids, job.cache_salt)
            policy = (thinking_policy(self.markers, prompt.token_ids, params.thinking_budget)
                      if self.markers is not None else None)
            for sample_index in range(params.n):
                request_id = f"{job.request_id}-{prompt_index}-{sample_index}"
                seed = None if params.seed is None else (params.seed + sample_index) & UINT64_MASK
                output = OutputText(hf_tokenizer, prompt.token_ids, stop_strings=params.stop_strings,
                                    include_stop_str_in_output=params.include_stop_str_in_output,
                                    skip_special_tokens=params.skip_special_tokens, min_tokens=params.min_tokens)
                sample = Sample(len(self.samples), prompt_index, request_id, output)
                if policy is not None:
                    sample.splitter = ReasoningSplitter(policy)
                    if job.chat:
                        sample.reasoning = OutputText(hf_tokenizer, prompt.token_ids,
                                                      skip_special_tokens=params.skip_special_tokens)
                self.samples.append(sample)
                self._by_id[request_id] = sample
                generates.append(Generate(
                    request_id=request_id, prompt_token_ids=prompt.token_ids, block_hashes=hashes,
                    params=params.to_wire(job.max_tokens[prompt_index], seed), priority=job.priority,
                    arrival_time=time.time(), cache_salt=job.cache_salt,
                    thinking=policy if params.thinking_budget is not None else None))
        self._unfinished = len(self.samples)
        self._stream = self.client.submit(generates)

    def close(self) -> None:
        """Abort what is still running; safe to call at any point, and more than once."""
        if self._stream is not None:
            self._stream.close()

    async def updates(self) -> AsyncIterator[list[Update]]:
        """Batches of per-choice updates until every choice has finished.

        Raises WorkerLost if the worker dies, ApiError if the worker refuses a sample.
        """
        assert self._stream is not None, "start() first"
        while self._unfinished:
            deltas = await self._stream.next()
            updates: dict[int, Update] = {}
            for delta in deltas:
                sample = self._by_id[delta.request_id]
                if sample.finish_reason is not None:
                    continue
                update = updates.get(sample.index)
                if update is None:
                    update = updates[sample.index] = Update(sample, "", [])
                self._apply(update, delta)
            if updates:
                yield sorted(updates.values(), key=lambda u: u.sample.index)

    def _apply(self, update: Update, delta: RequestDelta) -> None:
        sample = update.sample
        if delta.error is not None or delta.finish_reason is FinishReason.ERROR:
            raise api.bad_request(f"the engine refused the request: {delta.error or 'no reason given'}",
                                  code="engine_refused")
        if delta.num_cached_tokens >= 0:
            sample.num_cached_tokens = delta.num_cached_tokens
        new_ids = delta.new_token_ids
        sample.num_tokens += len(new_ids)
        content_ids = new_ids
        if sample.splitter is not None:
            reasoning_ids, split_content = sample.splitter.feed(new_ids)
            if delta.finish_reason is not None:
                held_reasoning, held_content = sample.splitter.flush()
                reasoning_ids, split_content = reasoning_ids + held_reasoning, split_content + held_content
            if sample.reasoning is not None:
                update.reasoning_text += sample.reasoning.push(reasoning_ids)
                # min_tokens counts every output token, thinking included.
                sample.output.num_tokens += len(new_ids) - len(split_content)
                content_ids = split_content
        update.text += sample.output.push(content_ids)
        if delta.logprobs:
            update.logprobs.extend(delta.logprobs)
        if sample.output.stop is not None:
            self._finish(sample, FinishReason.STOP.value, sample.output.stop)
            self._stream.finish(sample.request_id, FinishReason.STOP.value)
        elif delta.finish_reason is not None:
            if sample.reasoning is not None:
                update.reasoning_text += sample.reasoning.finish()
            update.text += sample.output.finish()
            stop_reason = None
            if delta.finish_reason is FinishReason.STOP and delta.new_token_ids:
                last = delta.new_token_ids[-1]
                stop_reason = last if last in self.job.params.stop_token_ids else None
            self._finish(sample, delta.finish_reason.value, stop_reason)

    def _finish(self, sample: Sample, reason: str, stop_reason: int | str | None) -> None:
        sample.finish_reason, sample.stop_reason = reason, stop_reason
        self._unfinished -= 1

    def usage(self) -> answers.Usage:
        job = self.job
        num_prompt = sum(len(p.token_ids) for p in job.prompts)
        num_completion = sum(s.num_tokens for s in self.samples)
        # Each prompt's cached tokens as its first sample saw them.
        num_cached = sum(s.num_cached_tokens for s in self.samples if s.index % job.params.n == 0)
        details = None
        if self.markers is not None:
            details = answers.CompletionTokensDetails(sum(s.splitter.num_reasoning_tokens for s in self.samples))
        return answers.Usage(num_prompt, num_completion, num_prompt + num_completion,
                         answers.PromptTokensDetails(num_cached), details)
