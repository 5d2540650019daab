"""What `LLM.generate` and `LLM.chat` return, with vLLM's field names (vllm.outputs), and
how a finished sample of the server's Generation becomes one."""

from __future__ import annotations

from dataclasses import dataclass

from spillway.gateway.text.reasoning import ReasoningMarkers
from spillway.gateway.generation.serving import Sample
from spillway.gateway.text.tokenizer import PromptTokenizer
from spillway.protocol.messages import TokenLogprobs


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
    # With SamplingParams.prompt_logprobs: None for the first prompt token, then one dict each.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


def prompt_logprobs_output(sample: Sample, tokenizer: PromptTokenizer | None) -> list[dict[int, Logprob] | None] | None:
    """vLLM's `RequestOutput.prompt_logprobs` from the entries the sample's first delta carried."""
    if sample.prompt_logprobs is None:
        return None
    return [None] + [_logprob_dict(entry, tokenizer) for entry in sample.prompt_logprobs]


def completion_output(sample: Sample, sample_index: int, logprobs: list[TokenLogprobs] | None,
                      tokenizer: PromptTokenizer | None, markers: ReasoningMarkers | None) -> CompletionOutput:
    """A finished sample of a Generation (run with `keep_whole_text`) as vLLM's `CompletionOutput`;
    with a reasoning parser, its text also split into reasoning and answer."""
    decoded, cumulative = None, None
    if logprobs is not None:
        decoded = [_logprob_dict(entry, tokenizer) for entry in logprobs]
        cumulative = sum(entry.logprob for entry in logprobs)
    completion = CompletionOutput(index=sample_index, text=sample.text, token_ids=list(sample.token_ids),
                                  cumulative_logprob=cumulative, logprobs=decoded,
                                  finish_reason=sample.finish_reason, stop_reason=sample.stop_reason)
    if sample.splitter is not None:
        completion.reasoning_content = sample.reasoning.text or None
        completion.content = sample.output.text
        completion.num_reasoning_tokens = sample.splitter.num_reasoning_tokens
        if sample.splitter.policy.prompt_opened:
            # The chat template wrote the start marker; the raw text shows it, as the model saw it.
            completion.text = markers.start_text + completion.text
    return completion


def _logprob_dict(entry: TokenLogprobs, tokenizer: PromptTokenizer | None) -> dict[int, Logprob]:
    decode = (lambda t: tokenizer.decode([t], False)) if tokenizer else (lambda t: None)
    result = {tid: Logprob(lp, rank + 1, decode(tid))
              for rank, (tid, lp) in enumerate(zip(entry.top_token_ids, entry.top_logprobs))}
    if entry.token_id not in result:
        result[entry.token_id] = Logprob(entry.logprob, entry.rank, decode(entry.token_id))
    return result
