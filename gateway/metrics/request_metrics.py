"""vLLM's per-request histograms on /metrics, under its names and bucket bounds.

The times follow vLLM's split of a request's life, each on the gateway's clock except the
queue time, which the worker measures (RequestDelta.queued_s):

    arrival ── queue ──▶ scheduled ── prefill ──▶ first token ── decode ──▶ last token
            └──────────────── e2e (to the end) ─────────────────────────────────────┘
                         └───────────── inference ──────────────────────────────────┘

"scheduled" is the arrival plus the worker's queue time, so the hop to the worker counts as
prefill. A request that ends before its first token (aborted while queued) adds to e2e and
the token counts only.
"""

from __future__ import annotations

from dataclasses import dataclass

from spillway.gateway.metrics.families import EngineLabels

REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                         10.0, 20.0, 40.0, 80.0)
PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
DEFAULT_MAX_MODEL_LEN = 1 << 20  # the token-count buckets' reach when the length is not known at start


def one_two_five_buckets(limit: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (vLLM's buckets for token counts)."""
    buckets, scale = [], 1
    while True:
        for step in (1, 2, 5):
            if step * scale > limit:
                return buckets
            buckets.append(step * scale)
        scale *= 10


@dataclass(slots=True)
class RequestTimes:
    """One request's milestones (time.monotonic) and token counts, kept as its deltas arrive."""

    arrival: float
    num_prompt_tokens: int
    first_token: float | None = None
    last_token: float | None = None
    queued_s: float = -1.0  # the worker's measure, from the first delta
    num_generation_tokens: int = 0


class RequestMetrics:
    """One engine's histograms observed once per request (and TTFT / inter-token gaps as they
    happen)."""

    def __init__(self, labels: EngineLabels, max_model_len: int | None = None) -> None:
        histogram = labels.histogram
        token_buckets = one_two_five_buckets(max_model_len or DEFAULT_MAX_MODEL_LEN)
        self.time_to_first_token = histogram("vllm:time_to_first_token_seconds",
                                             "Time from arrival to the first generated token.", TTFT_BUCKETS)
        self.inter_token_latency = histogram("vllm:inter_token_latency_seconds",
                                             "Time between consecutive generated tokens.", TOKEN_LATENCY_BUCKETS)
        self.time_per_output_token = histogram("vllm:time_per_output_token_seconds",
                                               "Time per output token after the first (each gap, as vLLM).",
                                               TOKEN_LATENCY_BUCKETS)
        self.e2e_request_latency = histogram("vllm:e2e_request_latency_seconds",
                                             "Time from arrival to the end of the request.", REQUEST_LATENCY_BUCKETS)
        self.queue_time = histogram("vllm:request_queue_time_seconds",
                                    "Time a request waited in the worker before its first step.",
                                    REQUEST_LATENCY_BUCKETS)
        self.inference_time = histogram("vllm:request_inference_time_seconds",
                                        "Time from the first step to the last token.", REQUEST_LATENCY_BUCKETS)
        self.prefill_time = histogram("vllm:request_prefill_time_seconds",
                                      "Time from the first step to the first token.", REQUEST_LATENCY_BUCKETS)
        self.decode_time = histogram("vllm:request_decode_time_seconds",
                                     "Time from the first token to the last.", REQUEST_LATENCY_BUCKETS)
        self.prompt_tokens = histogram("vllm:request_prompt_tokens", "Prompt tokens per request.", token_buckets)
        self.generation_tokens = histogram("vllm:request_generation_tokens", "Tokens generated per request.",
                                           token_buckets)
        self.params_n = histogram("vllm:request_params_n", "The n of each request.", PARAMS_N_BUCKETS)
        self.params_max_tokens = histogram("vllm:request_params_max_tokens", "The max_tokens of each request.",
                                           token_buckets)

    def on_params(self, n: int, max_tokens: int) -> None:
        self.params_n.observe(n)
        self.params_max_tokens.observe(max_tokens)

    def on_finished(self, times: RequestTimes, now: float) -> None:
        self.e2e_request_latency.observe(now - times.arrival)
        self.prompt_tokens.observe(times.num_prompt_tokens)
        self.generation_tokens.observe(times.num_generation_tokens)
        if times.first_token is None or times.last_token is None:
            return
        queued_s = max(times.queued_s, 0.0)
        scheduled = min(times.arrival + queued_s, times.first_token)
        self.queue_time.observe(queued_s)
        self.prefill_time.observe(times.first_token - scheduled)
        self.decode_time.observe(times.last_token - times.first_token)
        self.inference_time.observe(times.last_token - scheduled)
