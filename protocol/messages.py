"""Wire messages between the gateway and a worker.

Two PUSH/PULL pairs:

    gateway -> worker:  Generate | Abort | Control | KvSourceLost   (`GatewayMessage`)
    worker  -> gateway: Ready | StepOutputs | WorkerError  (`WorkerMessage`)

Every message is an immutable msgspec Struct in a tagged union, encoded as msgpack.
Fields are append-only: a new field always has a default, so an older peer still decodes.
This module imports only msgspec and the standard library.
"""

from __future__ import annotations

from enum import Enum
from typing import NewType

import msgspec

from spillway.protocol.reasoning import ThinkingPolicy

PROTOCOL_VERSION = 3

RequestId = NewType("RequestId", str)
BlockHash = NewType("BlockHash", bytes)


class FinishReason(str, Enum):
    STOP = "stop"  # EOS or a stop token id
    LENGTH = "length"  # max_tokens or max_model_len
    ABORT = "abort"  # the gateway aborted it
    ERROR = "error"  # the worker refused or failed it


class StructuredKind(str, Enum):
    """What a constrained request's `StructuredOutput.spec` holds (vLLM's structured_outputs)."""

    JSON = "json"  # a JSON schema, as JSON text
    JSON_OBJECT = "json_object"  # any JSON object; spec ""
    REGEX = "regex"  # a regular expression the whole answer matches
    CHOICE = "choice"  # a JSON list of strings, the answer exactly one of them
    GRAMMAR = "grammar"  # an EBNF (GBNF) or Lark grammar
    STRUCTURAL_TAG = "structural_tag"  # free text in which tags start constrained parts, as JSON


class StructuredOutput(msgspec.Struct, frozen=True, kw_only=True):
    """The language a request's answer must belong to. The worker compiles it (cached by
    value) and masks each step's logits to the tokens that keep the answer inside it; a
    reasoning model's thinking is left free, the answer after its end marker constrained."""

    kind: StructuredKind
    spec: str = ""
    compact: bool = False  # JSON kinds: no whitespace between tokens (vLLM's disable_any_whitespace)


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """Everything the worker needs to sample one request. Validated by the gateway."""

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) disables
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    logprobs: int | None = None  # None: none; N: the sampled token plus the top N
    prompt_logprobs: int | None = None  # the same for each prompt token after the first
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    structured: StructuredOutput | None = None

    @property
    def greedy(self) -> bool:
        # Below this, dividing by the temperature overflows float32: treat it as greedy.
        return self.temperature < 1e-5


class KvSource(msgspec.Struct, frozen=True, kw_only=True):
    """Where a consumer worker pulls a prefilled request's blocks from (protocol/kv_transfer.py)."""

    address: str  # the producer's KV server: its Ready.kv_address


class Generate(msgspec.Struct, frozen=True, tag=True, kw_only=True):
    request_id: str
    # A list, or the ids packed as little-endian uint32 (`pack_token_ids`), as the gateway
    # sends them: bytes cost a copy to encode and decode where a list of 10k ints costs
    # ~0.3 ms each way, on both processes' one thread.
    prompt_token_ids: list[int] | bytes
    # Chained hashes of the prompt's full blocks (protocol/hashing.py), computed by the gateway.
    block_hashes: list[bytes]
    params: SamplingParams
    priority: int = 0
    arrival_time: float = 0.0
    # Mixed into block 0's hash; the worker needs it when generated tokens complete block 0.
    cache_salt: str | None = None
    # Markers and budget of a reasoning model's thinking (protocol/reasoning.py).
    thinking: ThinkingPolicy | None = None
    # The client request (every choice and prompt of one HTTP request) this Generate belongs
    # to: the worker shares its KV pool and steps between client requests (worker/core/fair_share.py).
    # Empty: it stands alone.
    parent_id: str = ""
    # Disaggregated decode: the prompt was prefilled by the producer named here; the worker
    # pulls the prompt's blocks it lacks from it before running the request. None: no transfer.
    kv_source: KvSource | None = None


class Abort(msgspec.Struct, frozen=True, tag=True):
    request_ids: list[str]


class KvSourceLost(msgspec.Struct, frozen=True, tag=True):
    """The gateway lost the producer at `address`: a consumer's pulls from it fail now
    (kv_load_failure_policy), rather than when their answer is overdue."""

    address: str


class ControlCommand(str, Enum):
    SHUTDOWN = "shutdown"
    RESET_PREFIX_CACHE = "reset_prefix_cache"
    CHECK_INVARIANTS = "check_invariants"  # answered with a StepOutputs carrying Stats
    STATS = "stats"
    # A gateway (re)attaching to a worker that may be running already (a remote one): the
    # worker answers with its Ready; the first HELLO of a new gateway session aborts, without
    # a word, every request of the sessions before (their gateway is gone).
    HELLO = "hello"


class Control(msgspec.Struct, frozen=True, tag=True):
    command: ControlCommand
    session: bytes = b""  # HELLO: the gateway's session, random per gateway process


class Ready(msgspec.Struct, frozen=True, tag=True, kw_only=True):
    protocol_version: int
    model: str
    block_size: int
    hash_seed: bytes
    num_gpu_blocks: int
    num_cpu_blocks: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    vocab_size: int
    eos_token_ids: list[int]
    device: str
    dtype: str
    enable_prefix_caching: bool = True
    # Random per worker process: a Ready with the attached worker's session is that worker
    # answering a HELLO again, not a restart.
    worker_session: bytes = b""
    # A producer's KV server, where consumers pull its blocks (protocol/kv_transfer.py); "": none.
    kv_address: str = ""
    # The worker's --kv-transfer-config role ("kv_producer", "kv_consumer", "kv_both"); "": none.
    kv_role: str = ""


class TokenLogprobs(msgspec.Struct, frozen=True, array_like=True):
    """Log-probabilities (of the model's raw distribution) around one sampled token."""

    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token
    top_token_ids: list[int]
    top_logprobs: list[float]


class RequestDelta(msgspec.Struct, frozen=True, kw_only=True):
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprobs] | None = None
    # Set on the request's first delta: prompt tokens whose KV came from the prefix cache.
    num_cached_tokens: int = -1
    # Set on the request's first delta: seconds from the worker's receipt to its first step
    # (vllm:request_queue_time_seconds); -1 on later deltas.
    queued_s: float = -1.0
    # On the request's first delta, when asked for (prompt_logprobs): one per prompt token after the first.
    prompt_logprobs: list[TokenLogprobs] | None = None
    error: str | None = None


class Stats(msgspec.Struct, frozen=True, kw_only=True):
    num_running: int = 0
    num_waiting: int = 0
    gpu_cache_usage: float = 0.0  # fraction of GPU blocks referenced by requests
    cpu_cache_usage: float = 0.0  # fraction of CPU tier blocks holding a copy
    num_gpu_blocks: int = 0
    num_free_gpu_blocks: int = 0
    num_cpu_blocks: int = 0
    # Cumulative, in tokens: prompt tokens looked up in the prefix cache, and those found,
    # split by the tier that held them.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    cached_tokens_gpu: int = 0
    cached_tokens_cpu: int = 0
    # The CPU tier's own lookups (vLLM's external prefix cache): prompt tokens past the GPU
    # hits, those found; and cumulative copies between the tiers.
    cpu_prefix_cache_queries: int = 0
    cpu_prefix_cache_hits: int = 0
    kv_offload_bytes_gpu_to_cpu: int = 0
    kv_offload_bytes_cpu_to_gpu: int = 0
    kv_offload_seconds_gpu_to_cpu: float = 0.0
    kv_offload_seconds_cpu_to_gpu: float = 0.0
    num_preemptions: int = 0
    num_steps: int = 0
    # Speculative decoding, cumulative (vLLM's vllm:spec_decode_* counters): verified requests
    # with drafts, draft tokens, accepted ones, and accepted ones by draft position.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_num_accepted_tokens_per_pos: list[int] = []
    # Tokens of each engine step since the report before (prompt tokens computed plus tokens
    # generated), for vLLM's vllm:iteration_tokens_total; only this report carries them.
    iteration_tokens: list[int] = []
    # Disaggregated prefill and decode, cumulative: KV bytes pulled into this worker and served
    # from it, the seconds they took (a pull's from asking to its blocks taken; a serve's
    # gathering and sending), and pulls that failed (kv_load_failure_policy applied).
    kv_transfer_bytes_received: int = 0
    kv_transfer_bytes_sent: int = 0
    kv_transfer_seconds_received: float = 0.0
    kv_transfer_seconds_sent: float = 0.0
    kv_transfer_failures: int = 0
    # Whether the block manager's invariants held; None: not checked for this report (they
    # are checked on CHECK_INVARIANTS and, in debug mode, always: the walk is O(blocks)).
    invariants_ok: bool | None = None


class KvEvents(msgspec.Struct, frozen=True, array_like=True):
    """Changes to the set of prefix blocks a worker holds (GPU pool or CPU tier), since its last report.

    A consumer that applies every report in order, `if cleared: held = set()`, then
    `held |= stored`, then `held -= removed`, holds the hashes the worker's prefix cache can find.
    A block moving between the tiers is no change. A hash stored and removed between two
    reports may appear in `removed` only (or in neither)."""

    stored: list[bytes]  # block hashes the worker now holds and did not before, in the order they were stored
    # Block hashes it no longer holds anywhere (evicted from the GPU pool and not in the CPU tier,
    # or dropped from the tier and not on the GPU).
    removed: list[bytes]
    # The cache was reset (reset_prefix_cache), or this is the whole set for a gateway that
    # attached anew (HELLO): everything reported before this report is gone; `stored` then lists
    # what is held after the reset.
    cleared: bool = False


class StepOutputs(msgspec.Struct, frozen=True, tag=True, kw_only=True):
    step: int
    outputs: list[RequestDelta]
    stats: Stats | None = None
    # Set on a heartbeat (worker/heartbeat.py, no outputs, no stats): seconds the worker's busy
    # loop has spent in its current stage (a wait for messages, or a step). None on the loop's
    # own messages.
    iteration_s: float | None = None
    # With WorkerConfig.kv_events: the prefix-cache changes since the report before, when there
    # are any; every link hears each report once (worker/main.py). Never on a heartbeat.
    kv_events: KvEvents | None = None


# How often a worker beats (worker/heartbeat.py): four times a second, since the gateway's bounds
# on silence are seconds and a beat is ~20 bytes of msgpack. The gateway counts missed beats.
HEARTBEAT_INTERVAL_S = 0.25
# A worker silent this long (no beat, no message) is stopped or frozen: a gateway's default bound
# (`--worker-heartbeat-timeout`); it leaves room for a pause of the whole host (swap, a debugger).
WORKER_SILENCE_TIMEOUT_S = 60.0


class WorkerError(msgspec.Struct, frozen=True, tag=True, kw_only=True):
    message: str
    fatal: bool = True
    traceback: str = ""


GatewayMessage = Generate | Abort | Control | KvSourceLost
WorkerMessage = Ready | StepOutputs | WorkerError


def gateway_decoder() -> msgspec.msgpack.Decoder:
    """Decoder for the worker's inbox."""
    return msgspec.msgpack.Decoder(GatewayMessage)


def worker_decoder() -> msgspec.msgpack.Decoder:
    """Decoder for the gateway's inbox."""
    return msgspec.msgpack.Decoder(WorkerMessage)


def encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()
