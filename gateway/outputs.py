"""What `LLM.generate` and `LLM.chat` return, with vLLM's field names (vllm.outputs), and
how a sample's collected tokens become one."""

from __future__ import annotations

from dataclasses import dataclass, field

from spillway.gateway.reasoning import ReasoningMarkers, ReasoningSplitter
from spillway.gateway.sampling_params import SamplingParams
from spillway.gateway.tokenizer import PromptTokenizer
from spillway.protocol.messages import TokenLogprobs
from spillway.protocol.reasoning import ThinkingPolicy


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # With a reasoning parser: the text split at the thinking markers (markers excluded).
    reasoning_content: str | None = None
    content: str | None = None
    num_reasoning_tokens: int = 0

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    num_cached_tokens: int = 0


@dataclass(slots=True)
class SampleState:
    """One sample (one of a prompt's n) of a generate call, as its deltas arrive."""

    prompt_index: int
    sample_index: int
    params: SamplingParams
    token_ids: list[int] = field(default_factory=list)
    logprobs: list | None = None
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    text: str | None = None
    thinking: ThinkingPolicy | None = None


def completion_output(state: SampleState, tokenizer: PromptTokenizer | None,
                      markers: ReasoningMarkers | None) -> CompletionOutput:
    """A finished sample as vLLM's `CompletionOutput`; with a thinking policy, the text is
    also split into reasoning and answer."""
    text = state.text
    if text is None:
        text = tokenizer.decode(state.token_ids, state.params.skip_special_tokens) if tokenizer else ""
    logprobs, cumulative = None, None
    if state.logprobs is not None:
        logprobs = [_logprob_dict(entry, tokenizer) for entry in state.logprobs]
        cumulative = sum(entry.logprob for entry in state.logprobs)
    completion = CompletionOutput(index=state.sample_index, text=text, token_ids=list(state.token_ids),
                                  cumulative_logprob=cumulative, logprobs=logprobs,
                                  finish_reason=state.finish_reason, stop_reason=state.stop_reason)
    if state.thinking is not None:
        _split_reasoning(completion, state, tokenizer, markers)
    return completion


def _split_reasoning(completion: CompletionOutput, state: SampleState, tokenizer: PromptTokenizer,
                     markers: ReasoningMarkers) -> None:
    splitter = ReasoningSplitter(state.thinking)
    reasoning, content = splitter.feed(state.token_ids)
    held_reasoning, held_content = splitter.flush()
    skip = state.params.skip_special_tokens
    completion.reasoning_content = tokenizer.decode(reasoning + held_reasoning, skip) or None
    completion.content = tokenizer.decode(content + held_content, skip)
    completion.num_reasoning_tokens = splitter.num_reasoning_tokens
    if state.thinking.prompt_opened:
        # The chat template wrote the start marker; the raw text shows it, as the model saw it.
        completion.text = markers.start_text + completion.text


def _logprob_dict(entry: TokenLogprobs, tokenizer: PromptTokenizer | None) -> dict[int, Logprob]:
    decode = (lambda t: tokenizer.decode([t], False)) if tokenizer else (lambda t: None)
    result = {tid: Logprob(lp, rank + 1, decode(tid))
              for rank, (tid, lp) in enumerate(zip(entry.top_token_ids, entry.top_logprobs))}
    if entry.token_id not in result:
        result[entry.token_id] = Logprob(entry.logprob, entry.rank, decode(entry.token_id))
    return result
