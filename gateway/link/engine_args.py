"""Engine arguments, checked once for `spillway serve | worker` and `LLM(...)`: the features
Spillway refuses (never accepts and ignores), the limits every value must keep, and the
WorkerConfig they become."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping

from spillway.protocol.attention_backends import ADDITIONAL_CONFIG_KEYS, backend_problem, uses_latent_attention
from spillway.protocol.local import envs
from spillway.protocol.config import KV_CACHE_DTYPES, QUANTIZATION_METHODS, WorkerConfig, setting_name
from spillway.protocol.local.model_files import ModelFiles, resolve_model
from spillway.protocol.model_len import long_max_model_len_problem, trained_length
from spillway.protocol.tensor_parallel import layout_problems

BLOCK_SIZES = (8, 16, 32, 64, 128)
DTYPES = ("auto", "float32", "float", "bfloat16", "float16", "half")

# vLLM arguments whose features Spillway does not have yet: (argument, the value that asks for
# nothing, feature). A value of None is never a request either. `{name}`: another setting, as
# the caller spells it.
NOT_YET = (
    ("swap_space", 0, "a swap space apart from the CPU KV tier ({cpu_offload_gb})"),
    ("enable_lora", False, "LoRA adapters"),
    ("pipeline_parallel_size", 1, "pipeline parallelism"),
)
NOT_YET_NAMES = frozenset(name for name, _, _ in NOT_YET)
# vLLM switches for what Spillway always does, with why it cannot be switched off.
ALWAYS_ON = (
    ("enable_chunked_prefill", "prompts are always prefilled in chunks of the step's token budget "
                               "({max_num_batched_tokens}): the scheduler has no whole-prompt prefill"),
)
ALWAYS_ON_NAMES = frozenset(name for name, _ in ALWAYS_ON)


class RefusedArgument(ValueError):
    """An argument the model or the other arguments rule out, found once the model is known
    (the command line exits with status 2 for it, as for a flag refused outright)."""


def refusals(values: Mapping[str, object], spell: Callable[[str, object], str],
             settings_spelling: str = "arguments") -> list[str]:
    """A message for every argument in `values` that asks for a feature Spillway lacks;
    `spell(name, value)` writes the argument as its caller's user gave it, `settings_spelling`
    (protocol/config.py) the other settings the message names."""
    names = _SpelledNames(settings_spelling)
    messages = []
    for name, off, feature in NOT_YET:
        value = values.get(name)
        if value is not None and value != off:
            messages.append(f"{spell(name, value)} needs {feature.format_map(names)}, which Spillway does not have yet")
    for name, why in ALWAYS_ON:
        if values.get(name) is False:
            messages.append(f"{spell(name, False)} cannot be honoured: {why.format_map(names)}")
    return messages


class _SpelledNames(dict):
    """Any setting's name, as `spelling` writes it, for str.format_map."""

    def __init__(self, spelling: str) -> None:
        super().__init__()
        self.spelling = spelling

    def __missing__(self, name: str) -> str:
        return setting_name(name, self.spelling)


def check_engine_args(*, block_size, max_num_seqs, max_model_len, max_num_batched_tokens, gpu_memory_utilization,
                      kv_cache_dtype, dtype, quantization=None, setting: Callable[[str], str] = str) -> None:
    """ValueError for a value no worker takes, before one is started; `setting` names an
    argument as the caller spells it."""
    if block_size not in BLOCK_SIZES:
        raise ValueError(f"{setting('block_size')} must be one of {', '.join(map(str, BLOCK_SIZES))}, "
                         f"got {block_size!r}")
    if not _is_int(max_num_seqs) or max_num_seqs < 1:
        raise ValueError(f"{setting('max_num_seqs')} must be a positive integer, got {max_num_seqs!r}")
    if max_model_len is not None and (not _is_int(max_model_len) or max_model_len < 2):
        raise ValueError(f"{setting('max_model_len')} must be an integer of at least 2, got {max_model_len!r}")
    if max_num_batched_tokens is not None and (not _is_int(max_num_batched_tokens) or max_num_batched_tokens < 1):
        raise ValueError(f"{setting('max_num_batched_tokens')} must be a positive integer, "
                         f"got {max_num_batched_tokens!r}")
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"{setting('gpu_memory_utilization')} must be in (0, 1], got {gpu_memory_utilization!r}")
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"{setting('kv_cache_dtype')} must be one of {', '.join(KV_CACHE_DTYPES)}, "
                         f"got {kv_cache_dtype!r}")
    if dtype not in DTYPES:
        raise ValueError(f"{setting('dtype')} must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if quantization is not None and quantization not in QUANTIZATION_METHODS:
        raise ValueError(f"{setting('quantization')} must be one of {', '.join(QUANTIZATION_METHODS)} (or none), "
                         f"got {quantization!r}")


def cpu_tier_gib(cpu_offload_gb: float | None = None, kv_offloading_size: float | None = None,
                 spell: Callable[[str, object], str] = lambda name, value: f"{name}={value!r}") -> float:
    """GiB of host memory for the CPU KV tier: `--cpu-offload-gb` or vLLM's newer name for it,
    `--kv-offloading-size` (both given: they must agree), else SPILLWAY_CPU_KVCACHE_SPACE or
    VLLM_CPU_KVCACHE_SPACE, else 0 (no tier). In vLLM `--cpu-offload-gb` offloads weights;
    here it sizes the KV tier. `spell` writes the arguments as the caller gave them."""
    if cpu_offload_gb is not None and kv_offloading_size is not None and cpu_offload_gb != kv_offloading_size:
        raise ValueError(f"{spell('cpu_offload_gb', cpu_offload_gb)} and "
                         f"{spell('kv_offloading_size', kv_offloading_size)} name the same CPU KV tier with two sizes")
    size = next((value for value in (cpu_offload_gb, kv_offloading_size) if value is not None), None)
    if size is None:
        size = envs.cpu_kvcache_space_gb() or 0.0
    if isinstance(size, bool) or not isinstance(size, (int, float)) or not math.isfinite(size) or size < 0:
        raise ValueError(f"the CPU KV tier's size must be a number of GiB >= 0, got {size!r}")
    return float(size)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_tensor_parallel(files: ModelFiles, size: int, *, spell: Callable[[str, object], str]) -> None:
    """RefusedArgument naming the argument (as `spell` writes it) when `size` ranks cannot split
    the model (its config.json's heads, KV heads and intermediate size)."""
    if not _is_int(size) or size < 1:
        raise RefusedArgument(f"{spell('tensor_parallel_size', size)}: must be a positive integer")
    if size == 1:
        return
    with open(files.path / "config.json", encoding="utf-8") as f:
        problems = layout_problems(size, json.load(f))
    if problems:
        raise RefusedArgument(f"{spell('tensor_parallel_size', size)}: " + "; ".join(problems))


def check_max_model_len(files: ModelFiles, max_model_len: int | None, spell: Callable[[str, object], str]) -> None:
    """RefusedArgument for a max_model_len past the model's trained context (its config.json),
    unless SPILLWAY_ALLOW_LONG_MAX_MODEL_LEN=1 (or vLLM's VLLM_ALLOW_LONG_MAX_MODEL_LEN=1)."""
    if max_model_len is None:
        return
    with open(files.path / "config.json", encoding="utf-8") as f:
        trained = trained_length(json.load(f))
    problem = long_max_model_len_problem(max_model_len, trained, envs.allow_long_max_model_len(), spell)
    if problem is not None:
        raise RefusedArgument(problem)


def additional_config_backend(additional_config: str | Mapping | None, spell: Callable[[str, object], str]
                              ) -> str | None:
    """The `mla_backend` of vLLM's additional configuration (a JSON object, or a mapping given to
    `LLM`); RefusedArgument for text that is no JSON object and for a key Spillway does not read
    (vLLM hands those to platform plugins, which Spillway does not have)."""
    if additional_config is None:
        return None
    values = additional_config
    if isinstance(additional_config, str):
        try:
            values = json.loads(additional_config)
        except json.JSONDecodeError as exc:
            raise RefusedArgument(f"{spell('additional_config', additional_config)}: not valid JSON ({exc})") from None
    if not isinstance(values, Mapping):
        raise RefusedArgument(f"{spell('additional_config', additional_config)}: must be a JSON object, "
                              f"such as {{\"mla_backend\": \"TRITON_MLA\"}}")
    for key in values:
        if key not in ADDITIONAL_CONFIG_KEYS:
            raise RefusedArgument(f"{spell('additional_config', additional_config)}: the key {key!r} needs platform "
                                  f"plugins' additional configuration, which Spillway does not have yet (it reads "
                                  f"{', '.join(ADDITIONAL_CONFIG_KEYS)} only)")
    backend = values.get("mla_backend")
    if backend is not None and not isinstance(backend, str):
        raise RefusedArgument(f"{spell('additional_config', additional_config)}: mla_backend must be a backend's "
                              f"name, got {backend!r}")
    return backend


def check_attention_backend(files: ModelFiles, attention_backend: str | None, additional_config: str | Mapping | None,
                            spell: Callable[[str, object], str]) -> str | None:
    """The attention backend asked for, by name or in the additional configuration, once checked
    against the model (its config.json): RefusedArgument, naming the argument as `spell` writes
    it, for a name vLLM does not have, one that does not fit the model, or two that disagree."""
    mla_backend = additional_config_backend(additional_config, spell)
    if attention_backend is not None and mla_backend is not None and attention_backend != mla_backend:
        raise RefusedArgument(f"{spell('attention_backend', attention_backend)} and "
                              f"{spell('additional_config', additional_config)} ask for two attention backends; "
                              f"give one, or the same in both")
    name, argument = (attention_backend, "attention_backend") if attention_backend is not None else \
        (mla_backend, "additional_config")
    if name is None:
        return None
    with open(files.path / "config.json", encoding="utf-8") as f:
        problem = backend_problem(name, uses_latent_attention(json.load(f)))
    if problem is not None:
        value = attention_backend if argument == "attention_backend" else additional_config
        raise RefusedArgument(f"{spell(argument, value)}: {problem}")
    return name


def engine_config(model: str | None, *, load_format: str = "auto", served_model_name: str | None = None,
                  spell: Callable[[str, object], str] = lambda name, value: f"{name}={value!r}",
                  settings_spelling: str = "arguments", **settings) -> tuple[WorkerConfig, ModelFiles]:
    """Check the arguments, resolve the model (converting a GGUF file once) and build the
    worker's configuration, its kernel switches from this process's environment. `spell`
    writes an argument as the caller's user gave it, for the messages; `settings_spelling`
    (one of SETTINGS_SPELLINGS) tells the worker, for its own."""
    defaults = WorkerConfig()
    settings["cpu_offload_gb"] = cpu_tier_gib(settings.get("cpu_offload_gb"), settings.pop("kv_offloading_size", None),
                                              spell)
    if settings["cpu_offload_gb"] and not settings.get("enable_prefix_caching", True):
        raise ValueError("the CPU KV tier keeps prefix-cache blocks: it needs prefix caching, which is turned off")
    check_engine_args(**{name: settings.get(name, getattr(defaults, name)) for name in (
        "block_size", "max_num_seqs", "max_model_len", "max_num_batched_tokens", "gpu_memory_utilization",
        "kv_cache_dtype", "dtype", "quantization")}, setting=lambda name: setting_name(name, settings_spelling))
    files = resolve_model(model, load_format)  # ValueError for unknown models
    check_tensor_parallel(files, settings.get("tensor_parallel_size", 1), spell=spell)
    check_max_model_len(files, settings.get("max_model_len"), spell)
    settings["attention_backend"] = check_attention_backend(
        files, settings.get("attention_backend"), settings.pop("additional_config", None), spell)
    config = envs.worker_config_from_env(model=str(files.path), served_model_name=served_model_name or files.name,
                                    load_format=files.load_format, settings_spelling=settings_spelling, **settings)
    return config, files
