"""Mutable worker-side state of one request, built from the immutable wire `Generate`."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Protocol

import numpy as np

from spillway.protocol.hashing import ids_below
from spillway.protocol.messages import BlockHash, FinishReason, Generate, SamplingParams, TokenLogprobs
from spillway.protocol.reasoning import Phase, ThinkingPolicy, ThinkingState, initial_state


class TokenGrammar(Protocol):
    """What the core needs of a constrained request's grammar (worker/sample/grammars.py)."""

    def accept(self, token_id: int) -> bool: ...

    def is_terminated(self) -> bool: ...


def has_penalties(params: SamplingParams) -> bool:
    return (params.presence_penalty != 0.0 or params.frequency_penalty != 0.0
            or params.repetition_penalty != 1.0)


class RequestStatus(IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2  # back in the waiting queue, its KV dropped; recomputed when resumed
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}
_FINISHED_STATUS = {reason: status for status, reason in _FINISH_REASONS.items()}


def finished_status(reason: FinishReason) -> RequestStatus:
    return _FINISHED_STATUS[reason]


@dataclass(slots=True)
class Request:
    """One request as the scheduler sees it.

    `num_computed_tokens` chases `num_tokens`: tokens [0, num_computed_tokens) of
    `all_token_ids` have their KV in the request's blocks; the rest are computed by the
    chunks the scheduler hands out. `block_hashes[i]` is the chained hash of full block i of
    `all_token_ids`; it may run ahead of the computed tokens (the gateway sends every full
    prompt block), but only computed blocks are ever committed to the prefix cache.

    The prompt stays as it came (packed ids stay a uint32 array over the message's bytes)
    until something needs it as a list: a chunk takes its slice (`token_ids`), and a prefix
    served from the cache is never read at all. Making 10,000 ids Python ints costs ~0.2 ms,
    which a burst of long prompts on one cached prefix would otherwise pay per request.
    """

    request_id: str
    prompt: list[int] | np.ndarray  # the ids as they came: a list, or packed ids viewed as uint32
    params: SamplingParams
    block_hashes: list[BlockHash]
    arrival_index: int
    priority: int = 0
    cache_salt: str | None = None
    # The client request it is one choice of (`Generate.parent_id`); empty: its own id.
    parent_id: str = ""
    # The output ids so far: appended by `append_token`, only read elsewhere.
    outputs: list[int] = field(init=False, default_factory=list)
    # The prompt and outputs as one list, made on first use (`all_token_ids`), then kept in step.
    _all: list[int] | None = field(init=False, default=None)
    num_computed_tokens: int = 0
    # Prompt tokens served from the prefix cache when first scheduled; -1 until then.
    num_cached_tokens: int = -1
    # When this worker received it, and how long it then waited to be scheduled (-1 until then).
    received: float = field(default_factory=time.monotonic)
    queued_s: float = -1.0
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0
    # 1 while a step that samples this request's next token is still on the device.
    num_pending_tokens: int = 0
    thinking_policy: ThinkingPolicy | None = None
    # Advanced with every committed output token; decides tokens forced by the budget.
    thinking_state: ThinkingState | None = field(init=False, default=None)
    # The device can choose this request's tokens from the logits alone: no logprobs to
    # report, no penalties over its history, no thinking budget, no grammar. With min_tokens reached, its
    # decode steps may run ahead of the host (worker/driver/pipeline.py). Fixed at arrival.
    samples_on_device: bool = field(init=False, default=False)
    # The same, but under a grammar's mask, which the host fills once the token before is
    # committed: its steps run ahead, their sampling launched after that commit
    # (worker/driver/engine.py). Fixed at arrival.
    samples_after_commit: bool = field(init=False, default=False)
    # The largest prompt id when known from the wire (packed ids: numpy found it in
    # microseconds); None: `refusal` scans the list.
    max_prompt_token_id: int | None = None
    # prompt_logprobs, when asked for: filled as the prompt's chunks run (worker/sample/logprobs.py).
    prompt_logprobs: list[TokenLogprobs] = field(init=False, default_factory=list)
    # A constrained request's matcher (worker/sample/grammars.py's RequestGrammar), set by the
    # engine once its grammar compiled; the answer's committed tokens advance it.
    grammar: TokenGrammar | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        if not self.parent_id:
            self.parent_id = self.request_id
        if self.thinking_policy is not None:
            self.thinking_state = initial_state(self.thinking_policy)
        params = self.params
        device_alone = params.logprobs is None and not has_penalties(params) and self.thinking_policy is None
        self.samples_on_device = device_alone and params.structured is None
        self.samples_after_commit = device_alone and params.structured is not None

    @classmethod
    def from_generate(cls, msg: Generate, arrival_index: int) -> Request:
        """ValueError for packed ids that are not whole uint32s."""
        prompt, max_id = msg.prompt_token_ids, None
        if isinstance(prompt, bytes):
            if len(prompt) % 4:
                raise ValueError(f"packed prompt token ids of {len(prompt)} bytes: not a multiple of 4")
            prompt = np.frombuffer(prompt, dtype="<u4")
            max_id = int(prompt.max()) if prompt.size else None
        return cls(
            request_id=msg.request_id,
            prompt=prompt,
            max_prompt_token_id=max_id,
            params=msg.params,
            block_hashes=list(msg.block_hashes),  # BlockHash is bytes: a copy, no wrapping
            arrival_index=arrival_index,
            priority=msg.priority,
            cache_salt=msg.cache_salt,
            parent_id=msg.parent_id,
            thinking_policy=msg.thinking,
        )

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.outputs)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt)

    @property
    def num_output_tokens(self) -> int:
        return len(self.outputs)

    @property
    def prompt_token_ids(self) -> list[int]:
        """The prompt as a list (made once from packed ids)."""
        if not isinstance(self.prompt, list):
            self.prompt = self.prompt.tolist()
        return self.prompt

    @property
    def output_token_ids(self) -> list[int]:
        return list(self.outputs)

    @property
    def all_token_ids(self) -> list[int]:
        """The prompt's ids, then the outputs', as one list: for readers of the whole sequence
        (n-gram drafts, prompt logprobs); a chunk reads `token_ids`."""
        if self._all is None:
            self._all = self.prompt_token_ids + self.outputs
        return self._all

    def token_ids(self, start: int, stop: int) -> list[int]:
        """`all_token_ids[start:stop]`, without making the whole list."""
        if self._all is not None:
            return self._all[start:stop]
        ids = self.prompt[start:stop]
        if not isinstance(ids, list):
            ids = ids.tolist()
        num_prompt = len(self.prompt)
        if stop > num_prompt:
            ids += self.outputs[max(start - num_prompt, 0):stop - num_prompt]
        return ids

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> FinishReason | None:
        return self.status.finish_reason

    @property
    def sampling_prompt(self) -> list[int] | np.ndarray:
        """The prompt as the sampler takes it: a list (made once) where penalties read it, else
        as held (the sampler reads only its length then)."""
        return self.prompt_token_ids if has_penalties(self.params) else self.prompt

    @property
    def in_answer(self) -> bool:
        """Past any thinking: where a grammar constrains the tokens (a reasoning model thinks
        freely, then answers in the grammar)."""
        return self.thinking_state is None or self.thinking_state.phase == Phase.ANSWER

    def append_token(self, token_id: int) -> None:
        self.outputs.append(token_id)
        if self._all is not None:
            self._all.append(token_id)


def refusal(request: Request, *, max_model_len: int, block_size: int, vocab_size: int | None = None,
            in_use: bool = False) -> str | None:
    """Why the worker cannot take `request`, or None: every check a request gets, in one place
    (the gateway validates first; this guards the worker against any sender)."""
    num_prompt = request.num_prompt_tokens
    if in_use:
        return f"request id {request.request_id!r} is already in use"
    if num_prompt == 0:
        return "the prompt is empty"
    if num_prompt >= max_model_len:
        return f"the prompt has {num_prompt} tokens; max_model_len={max_model_len} leaves no room for output"
    if vocab_size is not None and not _ids_below(request, vocab_size):
        return f"prompt token ids must lie in [0, {vocab_size})"
    if request.params.max_tokens < 1:
        return f"max_tokens must be at least 1, got {request.params.max_tokens}"
    thinking = request.thinking_policy
    if thinking is not None and (not thinking.start_token_ids or not thinking.end_token_ids
                                 or (thinking.budget is not None and thinking.budget < 0)):
        return "the thinking policy needs start and end markers and a non-negative budget"
    if len(request.block_hashes) > num_prompt // block_size:
        return f"{len(request.block_hashes)} block hashes for {num_prompt // block_size} full prompt blocks"
    return None


def _ids_below(request: Request, vocab_size: int) -> bool:
    """Whether every prompt id lies in [0, vocab_size): packed ids are unsigned and came with
    their maximum; a list is scanned once, in C."""
    if request.max_prompt_token_id is not None:
        return request.max_prompt_token_id < vocab_size
    return ids_below(request.prompt_token_ids, vocab_size)
