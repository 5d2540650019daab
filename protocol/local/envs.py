"""Every environment variable Spillway reads, read here and nowhere else."""

from __future__ import annotations

import os
from pathlib import Path

from spillway.protocol.config import WorkerConfig


def cache_dir() -> Path:
    """Where converted model files (dequantised GGUF weights, tokenizers) are kept."""
    root = os.environ.get("SPILLWAY_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "spillway"
    )
    return Path(root)


def debug_invariants() -> bool:
    """Check the block manager's invariants after every engine step (tests turn this on)."""
    return os.environ.get("SPILLWAY_DEBUG_INVARIANTS", "0") not in ("", "0", "false")


def cpu_kvcache_space_gb() -> float | None:
    """CPU KV tier size in GiB: SPILLWAY_CPU_KVCACHE_SPACE, else vLLM's VLLM_CPU_KVCACHE_SPACE;
    None when neither is set. Read into WorkerConfig by `engine_args.engine_config`."""
    for name in ("SPILLWAY_CPU_KVCACHE_SPACE", "VLLM_CPU_KVCACHE_SPACE"):
        value = os.environ.get(name)
        if value:
            try:
                return float(value)
            except ValueError:
                raise ValueError(f"{name}={value!r} is not a size in GiB") from None
    return None


def kv_load_gb_s() -> float | None:
    """SPILLWAY_KV_LOAD_GB_S: the most GB/s the CPU tier's loads take while other requests
    compute (worker/kv_tier/paced_loads.py); 0 loads at full speed always. None when unset. Read into
    WorkerConfig by `worker_config_from_env`."""
    value = os.environ.get("SPILLWAY_KV_LOAD_GB_S")
    if not value:
        return None
    try:
        rate = float(value)
    except ValueError:
        raise ValueError(f"SPILLWAY_KV_LOAD_GB_S={value!r} is not a rate in GB/s") from None
    if not rate >= 0:
        raise ValueError(f"SPILLWAY_KV_LOAD_GB_S={value!r}: a load rate must be >= 0 GB/s (0: never paced)")
    return rate


def grammar_compile_timeout_s() -> float | None:
    """SPILLWAY_GRAMMAR_COMPILE_TIMEOUT_S: seconds a structured-output grammar may take to
    compile (`WorkerConfig.grammar_compile_timeout_s`); None when unset."""
    value = os.environ.get("SPILLWAY_GRAMMAR_COMPILE_TIMEOUT_S")
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(f"SPILLWAY_GRAMMAR_COMPILE_TIMEOUT_S={value!r} is not a number of seconds") from None
    if not seconds > 0:
        raise ValueError(f"SPILLWAY_GRAMMAR_COMPILE_TIMEOUT_S={value!r}: a time bound must be > 0 s")
    return seconds


def allow_long_max_model_len() -> bool:
    """SPILLWAY_ALLOW_LONG_MAX_MODEL_LEN=1 (or vLLM's VLLM_ALLOW_LONG_MAX_MODEL_LEN=1): take a
    max_model_len beyond the model's trained context instead of refusing it. Read into
    WorkerConfig by `worker_config_from_env`."""
    return any(os.environ.get(name, "0") not in ("", "0", "false")
               for name in ("SPILLWAY_ALLOW_LONG_MAX_MODEL_LEN", "VLLM_ALLOW_LONG_MAX_MODEL_LEN"))


def programmatic_launch() -> bool:
    """Launch the Triton kernels with programmatic dependent launch where the GPU supports it
    (SPILLWAY_PDL=0 turns it off, e.g. to measure what it saves). Read into WorkerConfig by
    `worker_config_from_env`; the worker uses its config's field."""
    return os.environ.get("SPILLWAY_PDL", "1") not in ("", "0", "false")


def input_major_weights() -> bool:
    """Store the decoder's projection weights input-major on a GPU (worker/models/gpu_linear.py;
    SPILLWAY_INPUT_MAJOR_WEIGHTS=0 keeps nn.Linear's row-major storage, e.g. to measure it).
    Read into WorkerConfig by `worker_config_from_env`; the worker uses its config's field."""
    return os.environ.get("SPILLWAY_INPUT_MAJOR_WEIGHTS", "1") not in ("", "0", "false")


def worker_key() -> str | None:
    """The secret that authenticates and encrypts a remote worker's link (protocol/local/link_auth.py):
    SPILLWAY_WORKER_KEY, the same on the gateway and the worker; `--worker-key-file` wins."""
    return os.environ.get("SPILLWAY_WORKER_KEY") or None


def step_trace_path() -> str | None:
    """SPILLWAY_STEP_TRACE=FILE: the worker appends a JSON line per busy step there
    (worker/step_trace.py), to see where a request's first token waited."""
    return os.environ.get("SPILLWAY_STEP_TRACE") or None


def worker_config_from_env(**settings) -> WorkerConfig:
    """A WorkerConfig whose kernel switches come from the environment of the process that
    configures the worker; explicit `settings` win. The worker uses its config's fields only."""
    switches = {"programmatic_launch": programmatic_launch(),
                "input_major_weights": input_major_weights(),
                "allow_long_max_model_len": allow_long_max_model_len()}
    if (rate := kv_load_gb_s()) is not None:
        switches["kv_load_gb_s"] = rate
    if (seconds := grammar_compile_timeout_s()) is not None:
        switches["grammar_compile_timeout_s"] = seconds
    return WorkerConfig(**{**switches, **settings})
