"""A worker's start-up configuration, and how a local worker receives it.

The gateway (or `LLM`) builds a `WorkerConfig`; a local worker is started as its own program
(`python -m spillway.worker`) and reads one `WorkerLaunch` from its stdin:

    stdin:  4-byte big-endian length || msgpack(WorkerLaunch)   then nothing until EOF

The gateway keeps the pipe open while it lives, so EOF on it means the gateway is gone (or
closed the worker): the worker exits then, even while it is still loading the model.
This module imports only msgspec and the standard library.
"""

from __future__ import annotations

import logging
import os
import struct
import threading

import msgspec

from spillway.protocol.hashing import DEFAULT_HASH_SEED
from spillway.protocol.kv_transfer import KvTransferConfig

# "auto": the model's dtype; "fp8" and "fp8_e4m3": float8 e4m3, unscaled (CUDA only).
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
# Weight quantization (vLLM's --quantization values Spillway runs): "fp8", the decoder's
# projections quantized at load to float8 e4m3 with a scale per output row. None: the
# checkpoint's own (an FP8 checkpoint runs in FP8 without it).
QUANTIZATION_METHODS = ("fp8",)

logger = logging.getLogger("spillway.worker")


SPECULATIVE_METHODS = ("draft_model", "ngram", "replay")
# How the caller wrote its settings, so that a message names the one the user gave:
# "flags" (`spillway serve`, `spillway worker`: --max-model-len 4096) or "arguments" (`LLM`,
# a WorkerConfig built in Python: max_model_len=4096).
SETTINGS_SPELLINGS = ("flags", "arguments")


def setting_name(name: str, spelling: str) -> str:
    """The setting `name` (a WorkerConfig field, an `LLM` argument) as `spelling` writes it:
    `--max-model-len` for "flags", `max_model_len` for "arguments"."""
    return "--" + name.replace("_", "-") if spelling == "flags" else name


class SpeculativeConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Speculative decoding (worker/speculative/): who proposes drafts and how many per step.

    `draft_model`: a small model with the target's tokenizer (`model`); `ngram`: prompt
    lookup over the request's own tokens; `replay`: a recorded target output per prompt
    (`replay_path`, JSON lines {"prompt_token_ids": [...], "output_token_ids": [...]}), for
    benchmarks only. Above `disable_by_batch_size` running requests a step decodes plainly.
    """

    method: str
    num_speculative_tokens: int
    model: str | None = None
    draft_tensor_parallel_size: int = 1
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    replay_path: str | None = None
    disable_by_batch_size: int = 32

    def problem(self, tensor_parallel_size: int = 1) -> str | None:
        """Why a worker of `tensor_parallel_size` ranks cannot run this configuration, or None."""
        if self.method not in SPECULATIVE_METHODS:
            return f"speculative method must be one of {', '.join(SPECULATIVE_METHODS)}, got {self.method!r}"
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            return f"num_speculative_tokens must be an integer of at least 1, got {k!r}"
        if self.draft_tensor_parallel_size not in (1, tensor_parallel_size):
            return (f"speculative draft tensor parallel size must be 1 or the tensor parallel size "
                    f"({tensor_parallel_size}), got {self.draft_tensor_parallel_size!r}")
        if self.method == "draft_model" and not self.model:
            return "the draft_model method needs a speculative model"
        if self.method != "draft_model" and self.model:
            return f"a speculative model is used by the draft_model method only, not {self.method!r}"
        if self.method == "ngram" and not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            return (f"ngram needs 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                    f"{self.prompt_lookup_min}, {self.prompt_lookup_max}")
        if self.method == "replay" and not self.replay_path:
            return "the replay method needs replay_path"
        if self.disable_by_batch_size < 1:
            return f"disable_by_batch_size must be at least 1, got {self.disable_by_batch_size}"
        return None


class WorkerConfig(msgspec.Struct, frozen=True, kw_only=True):
    """What a worker needs to start. Built by the gateway, sent to the worker process."""

    model: str | None = None
    served_model_name: str | None = None
    load_format: str = "auto"
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"  # one of KV_CACHE_DTYPES
    quantization: str | None = None  # one of QUANTIZATION_METHODS, or None
    device: str = "auto"
    seed: int = 0
    block_size: int = 16
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    # The CPU KV tier: GiB of (pinned) host memory for KV blocks; 0: none. The override, a
    # block count, wins (tests, benchmarks).
    cpu_offload_gb: float = 0.0
    num_cpu_blocks_override: int | None = None
    # GB/s the tier's loads take at most while other requests compute (worker/kv_tier/paced_loads.py;
    # SPILLWAY_KV_LOAD_GB_S, read by `worker_config_from_env`); 0: full speed always. A decode
    # step beside the loads slows by about 0.1% per GB/s of them on the H200 (docs/performance.md:
    # 1.024x its time alone at 26, 1.031x at 32, 1.048x at full speed, ~51 GB/s), under the 3%
    # aimed at; a GPU with less memory bandwidth pays more per GB/s and wants less.
    kv_load_gb_s: float = 26.0
    # Seconds a structured-output grammar may take to compile before its request is refused
    # (SPILLWAY_GRAMMAR_COMPILE_TIMEOUT_S, read by `worker_config_from_env`): a bound on what a
    # client waits, not a machine's speed. The 50-property schema of tools/bench/grammar takes
    # 0.5 s the first time on a 2-core CPU (the vocabulary built), 22 ms after that, 0.06 ms
    # cached (tools/bench/grammar/REPORT.md, docs/performance.md); 20 s is ~40x the worst.
    grammar_compile_timeout_s: float = 20.0
    enable_prefix_caching: bool = True
    enforce_eager: bool = False  # no CUDA graphs: every step runs eagerly
    # Plan the next decode step while the device runs this one; None: on for CUDA.
    async_scheduling: bool | None = None
    hash_seed: bytes = DEFAULT_HASH_SEED
    speculative: SpeculativeConfig | None = None  # None: no speculative decoding
    # Executor processes, one per device, each holding a shard of the model (worker/tp/group.py).
    tensor_parallel_size: int = 1
    # The attention backend the user named, vLLM's name (protocol/attention_backends.py), checked
    # against the model; the worker runs its own kernel and says so in its log. None: none named.
    attention_backend: str | None = None
    # Kernel switches, on by default; off only to measure what they save (SPILLWAY_PDL=0,
    # SPILLWAY_INPUT_MAJOR_WEIGHTS=0, read by `worker_config_from_env`, never by the worker).
    programmatic_launch: bool = True  # Triton kernels with programmatic dependent launch
    input_major_weights: bool = True  # projection weights stored input-major on a GPU
    # max_model_len beyond the model's trained context (SPILLWAY_ALLOW_LONG_MAX_MODEL_LEN=1, read
    # by `worker_config_from_env`): taken, not refused.
    allow_long_max_model_len: bool = False
    settings_spelling: str = "arguments"  # one of SETTINGS_SPELLINGS, for the worker's messages
    # Report the prefix blocks held as `KvEvents` on the StepOutputs (a gateway routing between
    # replicas by prefix needs them); off: nothing is recorded.
    kv_events: bool = False
    # Disaggregated prefill and decode (protocol/kv_transfer.py): this worker's role, and where its
    # KV server listens when it produces. None: no transfers.
    kv_transfer: KvTransferConfig | None = None

    def setting(self, name: str) -> str:
        """The setting `name` (a field's name) as the caller spells it: `--max-model-len` or
        `max_model_len`."""
        return setting_name(name, self.settings_spelling)

    def spell(self, name: str, value: object) -> str:
        """The setting `name` given `value`, as the caller wrote it: `--kv-cache-dtype fp8` or
        `kv_cache_dtype='fp8'`."""
        return f"{self.setting(name)} {value}" if self.settings_spelling == "flags" else f"{name}={value!r}"


class WorkerLaunch(msgspec.Struct, frozen=True, kw_only=True):
    """What a local worker reads on its stdin: its configuration and where its gateway listens."""

    config: WorkerConfig
    inbox: str  # gateway -> worker (the gateway binds it)
    outbox: str  # worker -> gateway
    parent_pid: int
    # (inbox, outbox) of each other API server on the gateway's port (`--api-server-count`)
    extra_links: list[tuple[str, str]] = []


_LENGTH = struct.Struct(">I")


def encode_launch(launch: msgspec.Struct) -> bytes:
    """The length-prefixed frame: the pipe stays open after it, so the length says where it ends."""
    payload = msgspec.msgpack.encode(launch)
    return _LENGTH.pack(len(payload)) + payload


def read_launch(fd: int, type: type = WorkerLaunch, sender: str = "the gateway"):
    """The launch frame of `type` from `fd` (a worker's or a rank's stdin), read unbuffered: the
    rest of the pipe belongs to `exit_when_gateway_closes` (its EOF: `sender` is gone)."""
    header = _read_exactly(fd, _LENGTH.size, sender)
    return msgspec.msgpack.decode(_read_exactly(fd, _LENGTH.unpack(header)[0], sender), type=type)


def _read_exactly(fd: int, size: int, sender: str) -> bytes:
    data = b""
    while len(data) < size:
        chunk = os.read(fd, size - len(data))
        if not chunk:
            raise EOFError(f"{sender} closed the launch pipe before the whole launch arrived")
        data += chunk
    return data


def exit_when_gateway_closes(fd: int) -> None:
    """Watch the launch pipe `fd` from a daemon thread; at EOF (the gateway exited, however it died),
    end this process at once, whatever its main thread is doing (loading a model, a step).

    Not PR_SET_PDEATHSIG: it fires when the *thread* that started the child exits, and gateways
    start workers from pool threads. os.read, not sys.stdin: a thread blocked in a buffered
    reader holds its lock, which the interpreter's shutdown then waits for in vain."""

    def watch() -> None:
        while os.read(fd, 1 << 12):
            pass
        logger.warning("the gateway process is gone; worker exiting")
        os._exit(0)

    threading.Thread(target=watch, name="spillway-gateway-watch", daemon=True).start()
