"""The settings of one OpenAI-compatible server (gateway/http/app.py): what it needs beyond the
worker's own configuration, built from `spillway serve`'s flags (gateway/cli/main.py) or by tests."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from spillway.gateway.link.client import DEFAULT_HEARTBEAT_TIMEOUT_S, DEFAULT_RESPONSE_TIMEOUT_S, DEFAULT_STEP_TIMEOUT_S
from spillway.gateway.api.request_defaults import RequestDefaults
from spillway.gateway.api.sampling_params import MAX_N
from spillway.gateway.text.template_sandbox import TemplateLimits
from spillway.protocol.config import WorkerConfig
from spillway.protocol.local.link_auth import LinkKeys

DEFAULT_MAX_BODY_BYTES = 8 << 20


@dataclass(slots=True)
class ServerSettings:
    """What the server needs beyond the worker's own configuration."""

    worker: WorkerConfig  # `model` is a resolved local folder
    served_model_names: list[str] = field(default_factory=list)
    model_root: str | None = None  # the model as it was named (/v1/models' root); else the first served name
    api_key: str | None = None
    chat_template: str | None = None
    # Requests may send chat templates of their own (else a 400), rendered in a child within these bounds.
    trust_request_chat_template: bool = False
    request_template_limits: TemplateLimits = field(default_factory=TemplateLimits)
    allow_special_tokens_in_content: bool = False  # else special-token text in messages is plain text
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_pending: int = 1024
    max_n: int = MAX_N  # choices (n) one request may ask for (--max-n), also bounded by max_num_seqs
    worker_address: str | None = None  # tcp://HOST:PORT: wait for a remote worker there
    # An API server beside the first (`--api-server-count`): the (inbox, outbox) it binds for
    # the worker the first one started, and its number. Only the first (0) turns the worker's
    # Stats into metrics and logs them.
    worker_link: tuple[str, str] | None = None
    api_server_index: int = 0
    ready_timeout_s: float = 600.0
    heartbeat_timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S  # the worker's silence that loses it
    step_timeout_s: float = DEFAULT_STEP_TIMEOUT_S  # one step's run that loses the worker
    worker_keys: LinkKeys | None = None  # the remote worker link's CURVE keys; required off loopback
    response_timeout_s: float | None = DEFAULT_RESPONSE_TIMEOUT_S  # a request's longest wait for the worker
    # Reasoning models: any of these enables splitting thinking from the answer.
    enable_reasoning: bool = False
    reasoning_parser: str | None = None  # deepseek_r1 (default) or qwen3
    reasoning_config: str | dict | None = None  # {"start", "end", "transition"}: markers of one's own
    # Tool calling: tool_choice "auto" parses the output with this parser (vLLM's name); None
    # refuses "auto" ("required" and named functions need no parser).
    tool_call_parser: str | None = None
    # The server owns its process (`spillway serve`): start-up's objects leave the collector's
    # reach. False where apps come and go in one process (tests), whose cycles would never be freed.
    freeze_startup_objects: bool = False
    tokenizer: str | None = None  # a folder with the tokenizer to use instead of the model's
    request_defaults: RequestDefaults = field(default_factory=RequestDefaults)
    log_stats: bool = False  # a stats line every 10 s while busy (`spillway serve` without --disable-log-stats)
    # Called (in a thread) once the app is ready, before the server listens: API servers 1..N-1
    # wait there for server 0, so that none answers /health before all do.
    serve_after: Callable[[], object] | None = None
    # Engine replicas behind this gateway (`--data-parallel-size`), each a worker of its own, and
    # how requests are spread over them (gateway/replicas/router.py).
    data_parallel_size: int = 1
    routing: str = "prefix"
    # Disaggregated prefill and decode behind this gateway (`--prefill-workers`, `--decode-workers`):
    # this many producer and consumer workers (gateway/replicas/prefill_decode.py); 0: none.
    prefill_workers: int = 0
    decode_workers: int = 0

    @property
    def num_engines(self) -> int:
        """The workers behind this gateway, each an engine of the metrics."""
        return self.prefill_workers + self.decode_workers if self.prefill_workers else self.data_parallel_size

    @property
    def reasoning(self) -> bool:
        return bool(self.enable_reasoning or self.reasoning_parser or self.reasoning_config is not None)
