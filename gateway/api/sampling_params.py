"""User-facing sampling parameters, with vLLM's field names, checked before any work starts."""

from __future__ import annotations

from dataclasses import InitVar, dataclass, field

from spillway.gateway.api.structured_outputs import StructuredOutputsParams
from spillway.protocol import messages as wire

MAX_LOGPROBS = 20
MAX_N = 128


@dataclass(slots=True)
class SamplingParams:
    """How to sample one prompt. Same names and defaults as vLLM's `SamplingParams`.

    `temperature=0` is greedy. `top_k` of 0 or -1 disables top-k. `logprobs=N` returns the
    sampled token's log-probability and the N most likely ones at each step; `prompt_logprobs=N`
    the same for each prompt token after the first.
    Invalid values raise ValueError at construction.
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Reasoning models: at most this many tokens inside <think> ... </think>.
    thinking_budget: int | None = None
    thinking_token_budget: InitVar[int | None] = None  # alias of thinking_budget
    # The language the answer must belong to (JSON schema, regex, choice, grammar).
    structured_outputs: StructuredOutputsParams | None = None
    stop_strings: list[str] = field(init=False, default_factory=list)

    def __post_init__(self, thinking_token_budget: int | None) -> None:
        if thinking_token_budget is not None:
            _check(self.thinking_budget in (None, thinking_token_budget),
                   "thinking_budget and thinking_token_budget disagree")
            self.thinking_budget = thinking_token_budget
        _check(self.thinking_budget is None or (_is_int(self.thinking_budget) and self.thinking_budget >= 0),
               f"thinking_budget must be a non-negative integer, got {self.thinking_budget!r}")
        self.stop_strings = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        _check(_is_int(self.n) and 1 <= self.n <= MAX_N, f"n must be an integer in [1, {MAX_N}], got {self.n!r}")
        _check(_is_number(self.temperature) and self.temperature >= 0,
               f"temperature must be non-negative, got {self.temperature!r}")
        _check(_is_number(self.top_p) and 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p!r}")
        _check(_is_int(self.top_k) and (self.top_k >= -1),
               f"top_k must be -1 or 0 (disabled) or a positive integer, got {self.top_k!r}")
        _check(_is_number(self.min_p) and 0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_is_number(value) and -2 <= value <= 2, f"{name} must be in [-2, 2], got {value!r}")
        _check(_is_number(self.repetition_penalty) and 0 < self.repetition_penalty <= 2,
               f"repetition_penalty must be in (0, 2], got {self.repetition_penalty!r}")
        _check(self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1),
               f"max_tokens must be at least 1, got {self.max_tokens!r}")
        _check(_is_int(self.min_tokens) and self.min_tokens >= 0,
               f"min_tokens must be non-negative, got {self.min_tokens!r}")
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens,
               f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        _check(self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
               f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        _check(self.prompt_logprobs is None
               or (_is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= MAX_LOGPROBS),
               f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs!r}")
        _check(self.seed is None or _is_int(self.seed), f"seed must be an integer, got {self.seed!r}")
        _check(all(isinstance(s, str) and s for s in self.stop_strings), "stop strings must be non-empty strings")
        _check(all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
               "stop_token_ids must be non-negative integers")
        _check(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
               "structured_outputs must be a StructuredOutputsParams")

    def to_wire(self, max_tokens: int, seed: int | None = None) -> wire.SamplingParams:
        """The worker's view; `max_tokens` is resolved by the caller (None means to the context end)."""
        return wire.SamplingParams(
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            temperature=float(self.temperature),
            top_p=float(self.top_p),
            top_k=0 if self.top_k == -1 else self.top_k,
            min_p=float(self.min_p),
            presence_penalty=float(self.presence_penalty),
            frequency_penalty=float(self.frequency_penalty),
            repetition_penalty=float(self.repetition_penalty),
            seed=self.seed if seed is None else seed,
            logprobs=self.logprobs,
            prompt_logprobs=self.prompt_logprobs,
            stop_token_ids=tuple(self.stop_token_ids),
            ignore_eos=self.ignore_eos,
            structured=None if self.structured_outputs is None else self.structured_outputs.to_wire(),
        )


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
