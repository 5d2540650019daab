"""From a validated OpenAI request to worker requests and back to text.

    request ─▶ Job (gateway/generation/jobs.py: prompts as token ids, sampling params, limits checked)
            ─▶ Generation.start(): one Generate per (prompt, sample), sent together
            ─▶ Generation.updates(): deltas → detokenized, stop-string-checked text per choice

With a reasoning parser every sample's token ids also run through a ReasoningSplitter; a chat
choice detokenizes its reasoning and its content as two streams (stop strings apply to the
content), and the markers belong to neither. The offline API (`keep_whole_text`) splits every
sample so, and keeps its whole text too (see WholeText).

Choice i of a request with n samples per prompt is sample i % n of prompt i // n. Every
Generate of one request names it as its parent (`Generate.parent_id`): the worker gives each
client request a fair share of its KV pool and steps (worker/core/fair_share.py), not each choice.

A stream that falls behind the worker (many streams, one event loop) finds several steps'
deltas waiting at once: without stop strings they are applied as one (`merge_deltas`), so
detokenization, usage and the SSE event cost once per batch instead of once per token. A stream
that keeps up gets each token alone, as it arrives.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import msgspec

from spillway.gateway.api import answers
from spillway.gateway.api import openai as api
from spillway.gateway.link.client import EngineClient, RequestStream
from spillway.gateway.text.detok import OutputText
from spillway.gateway.generation.jobs import Job
from spillway.gateway.text.reasoning import ReasoningMarkers, ReasoningSplitter, thinking_policy
from spillway.gateway.text.tokenizer import PromptTokenizer
from spillway.protocol.hashing import pack_token_ids
from spillway.protocol.messages import FinishReason, Generate, KvSource, RequestDelta, TokenLogprobs
from spillway.protocol.reasoning import Phase

UINT64_MASK = 2**64 - 1


@dataclass(slots=True)
class WholeText:
    """A split sample's whole text, thinking and markers included, with stop strings cutting it
    where they cut the content: every token goes through `head` until the answer begins, and
    from there on the whole text continues as the content does (from `content_from`).

    A stop string can only end the content before thinking starts (the whole text is then the
    content) or after it ends (the head is complete by then).
    """

    head: OutputText
    text: str | None = None  # the head's text, once the answer has begun
    content_from: int = 0  # where the answer begins in the content's text


@dataclass(slots=True)
class Sample:
    """One choice in flight."""

    index: int
    prompt_index: int
    request_id: str
    output: OutputText  # the content with a reasoning parser (chat), else the whole text
    splitter: ReasoningSplitter | None = None  # with a reasoning parser
    reasoning: OutputText | None = None  # the reasoning text (chat with a reasoning parser)
    whole: WholeText | None = None  # split samples of the offline API
    token_ids: list[int] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs] | None = None  # when asked for: each prompt token's after the first
    num_tokens: int = 0
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def text(self) -> str:
        """The whole output text so far (markers and thinking included)."""
        if self.whole is None:
            return self.output.text
        if self.whole.text is None:
            return self.whole.head.text
        return self.whole.text + self.output.text[self.whole.content_from:]


@dataclass(slots=True)
class Update:
    """What one batch of deltas did to one choice."""

    sample: Sample
    text: str
    logprobs: list[TokenLogprobs]
    reasoning_text: str = ""
    token_ids: list[int] = field(default_factory=list)  # the new output tokens

    @property
    def finished(self) -> bool:
        return self.sample.finish_reason is not None


class Generation:
    """Runs one Job on the worker and turns its deltas into per-choice text updates."""

    def __init__(self, job: Job, client: EngineClient, tokenizer: PromptTokenizer | None,
                 block_hashes, markers: ReasoningMarkers | None = None, *, keep_whole_text: bool = False) -> None:
        self.job = job
        self.markers = markers
        self.keep_whole_text = keep_whole_text
        self.client = client
        self.tokenizer = tokenizer
        self._block_hashes = block_hashes
        self.samples: list[Sample] = []
        self._by_id: dict[str, Sample] = {}
        self._stream: RequestStream | None = None
        self._unfinished = 0
        self._held: list[RequestDelta] | None = None  # the first deltas, read by `accepted`

    def start(self) -> None:
        """Send every sample to the worker; raises EngineUnavailable / EngineOverloaded."""
        job, params = self.job, self.job.params
        generates = []
        hf_tokenizer = self.tokenizer.tokenizer if self.tokenizer is not None else None
        # Decoding what another server prefilled (kv_transfer_params): the worker pulls the blocks first.
        remote = job.kv_transfer.remote_address if job.kv_transfer is not None else None
        kv_source = KvSource(address=remote) if remote is not None else None
        for prompt_index, prompt in enumerate(job.prompts):
            # Packed where the ids were checked (JobBuilder); `LLM`'s prompts are packed here.
            packed = prompt.packed if prompt.packed is not None else pack_token_ids(prompt.token_ids)
            hashes = self._block_hashes(packed, job.cache_salt)
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
                    if job.chat or self.keep_whole_text:
                        sample.reasoning = OutputText(hf_tokenizer, prompt.token_ids,
                                                      skip_special_tokens=params.skip_special_tokens)
                    if self.keep_whole_text:
                        sample.whole = WholeText(OutputText(hf_tokenizer, prompt.token_ids,
                                                            skip_special_tokens=params.skip_special_tokens))
                self.samples.append(sample)
                self._by_id[request_id] = sample
                generates.append(Generate(
                    request_id=request_id, prompt_token_ids=packed, block_hashes=hashes,
                    params=params.to_wire(job.max_tokens[prompt_index], seed), priority=job.priority,
                    arrival_time=time.time(), cache_salt=job.cache_salt,
                    thinking=policy if params.thinking_budget is not None else None,
                    parent_id=job.request_id,  # the worker shares its pool between client requests
                    kv_source=kv_source))
        self._unfinished = len(self.samples)
        self._stream = self.client.submit(generates, num_samples=params.n)

    @property
    def finished(self) -> bool:
        """Every choice has finished (once started): no update is left to come."""
        return self._stream is not None and not self._unfinished

    def close(self) -> None:
        """Abort what is still running; safe to call at any point, and more than once."""
        if self._stream is not None:
            self._stream.close()

    async def accepted(self) -> None:
        """Wait for the worker's first deltas, applied later by `updates`: a sample the worker
        refuses (a grammar that does not compile) raises ApiError here, before any answer is sent."""
        assert self._stream is not None, "start() first"
        if self._held is None and self._unfinished:
            self._held = await self._stream.next()
            for delta in self._held:
                _check_accepted(delta)

    async def updates(self) -> AsyncIterator[list[Update]]:
        """Batches of per-choice updates until every choice has finished.

        Raises WorkerLost if the worker dies, ApiError if the worker refuses a sample.
        """
        assert self._stream is not None, "start() first"
        # Stop strings are checked per delta: which token completes one decides the usage.
        merge = not self.job.params.stop_strings
        while self._unfinished:
            deltas, self._held = self._held or await self._stream.next(), None
            if merge and len(deltas) > 1:
                deltas = merge_deltas(deltas)
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
        """Apply one delta (or several merged); the text is the same as one by one, as long as
        no stop string can end the sample in the middle of them."""
        sample = update.sample
        _check_accepted(delta)
        if len(delta.new_token_ids) > 1 and self.job.params.stop_strings:
            self._apply_token_by_token(update, delta)
            return
        if delta.num_cached_tokens >= 0:
            sample.num_cached_tokens = delta.num_cached_tokens
        if delta.prompt_logprobs is not None:
            sample.prompt_logprobs = delta.prompt_logprobs
        new_ids = delta.new_token_ids
        sample.num_tokens += len(new_ids)
        sample.token_ids.extend(new_ids)
        update.token_ids.extend(new_ids)
        start, whole = 0, sample.whole
        while whole is not None and whole.text is None and start < len(new_ids):
            # Token by token until the answer begins, so the head ends exactly at its start.
            whole.head.push(new_ids[start:start + 1])
            self._route(update, sample, new_ids[start:start + 1])
            start += 1
            if sample.splitter.state.phase is Phase.ANSWER:
                whole.text, whole.content_from = whole.head.text + whole.head.finish(), len(sample.output.matcher.text)
        self._route(update, sample, new_ids[start:])
        if delta.finish_reason is not None and sample.splitter is not None:
            self._route_held(update, sample)
        if delta.logprobs:
            update.logprobs.extend(delta.logprobs)
        if sample.output.stop is not None:
            if whole is not None and whole.text is None:  # no thinking yet: the whole text is the content
                whole.text = ""
            self._finish(sample, FinishReason.STOP.value, sample.output.stop)
            self._stream.finish(sample.request_id, FinishReason.STOP.value)
        elif delta.finish_reason is not None:
            if sample.reasoning is not None:
                update.reasoning_text += sample.reasoning.finish()
            if whole is not None and whole.text is None:
                whole.head.finish()
            update.text += sample.output.finish()
            stop_reason = None
            if delta.finish_reason is FinishReason.STOP and delta.new_token_ids:
                last = delta.new_token_ids[-1]
                stop_reason = last if last in self.job.params.stop_token_ids else None
            self._finish(sample, delta.finish_reason.value, stop_reason)

    def _apply_token_by_token(self, update: Update, delta: RequestDelta) -> None:
        """A delta of several tokens (a run of accepted draft tokens), one token at a time: a
        stop string ends the output at the token that completes it, as without speculation."""
        last = len(delta.new_token_ids) - 1
        for index, token in enumerate(delta.new_token_ids):
            self._apply(update, msgspec.structs.replace(
                delta, new_token_ids=[token], finish_reason=delta.finish_reason if index == last else None,
                logprobs=delta.logprobs[index:index + 1] if delta.logprobs else None,
                num_cached_tokens=delta.num_cached_tokens if index == 0 else -1,
                prompt_logprobs=delta.prompt_logprobs if index == 0 else None))
            if update.sample.output.stop is not None:
                return

    def _route(self, update: Update, sample: Sample, token_ids: list[int]) -> None:
        """Output tokens to the sample's text: its content (and reasoning, when split)."""
        content_ids = token_ids
        if sample.splitter is not None:
            reasoning_ids, split_content = sample.splitter.feed(token_ids)
            if sample.reasoning is not None:
                update.reasoning_text += sample.reasoning.push(reasoning_ids)
                # min_tokens counts every output token, thinking included.
                sample.output.num_tokens += len(token_ids) - len(split_content)
                content_ids = split_content
        update.text += sample.output.push(content_ids)

    def _route_held(self, update: Update, sample: Sample) -> None:
        """At the end: tokens held as a possible marker are what they would be without one."""
        reasoning_ids, content_ids = sample.splitter.flush()
        if sample.reasoning is not None:
            update.reasoning_text += sample.reasoning.push(reasoning_ids)
            sample.output.num_tokens -= len(content_ids)  # counted when they arrived
            update.text += sample.output.push(content_ids)

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


def merge_deltas(deltas: list[RequestDelta]) -> list[RequestDelta]:
    """Each request's consecutive token-carrying deltas joined into one, in order; a delta
    without tokens (an abort, an error) is kept as it is and ends the run before it.

    The joined delta has every token and logprob of the run, the last finish reason and the
    last prefix-cache count that was set.
    """
    runs: dict[str, list[RequestDelta]] = {}  # request id -> its open run
    merged: list[list[RequestDelta]] = []
    for delta in deltas:
        joinable = bool(delta.new_token_ids) and delta.error is None
        run = runs.get(delta.request_id) if joinable else None
        if run is None:
            run = [delta]
            merged.append(run)
        else:
            run.append(delta)
        if joinable and delta.finish_reason is None:
            runs[delta.request_id] = run
        else:
            runs.pop(delta.request_id, None)
    return [run[0] if len(run) == 1 else _join(run) for run in merged]


def _join(run: list[RequestDelta]) -> RequestDelta:
    token_ids: list[int] = []
    logprobs: list[TokenLogprobs] | None = None
    num_cached_tokens = -1
    for delta in run:
        token_ids += delta.new_token_ids
        if delta.logprobs is not None:
            logprobs = list(delta.logprobs) if logprobs is None else logprobs + delta.logprobs
        if delta.num_cached_tokens >= 0:
            num_cached_tokens = delta.num_cached_tokens
    return RequestDelta(request_id=run[0].request_id, new_token_ids=token_ids, finish_reason=run[-1].finish_reason,
                        logprobs=logprobs, num_cached_tokens=num_cached_tokens,
                        prompt_logprobs=run[0].prompt_logprobs)


def _check_accepted(delta: RequestDelta) -> None:
    if delta.error is not None or delta.finish_reason is FinishReason.ERROR:
        raise api.bad_request(f"the engine refused the request: {delta.error or 'no reason given'}",
                              code="engine_refused")
