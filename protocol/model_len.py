"""The context a model was trained for, from its config.json, derived as vLLM derives it, and
the check of a max_model_len against it (the gateway runs it before a worker starts, the
worker again before its model loads). Imports only the standard library.

    trained = min(the config's position limits: max_position_embeddings, n_positions, ...)
              (2048 when it has none)
    rope scaling of a type other than llama3 / longrope (whose max_position_embeddings is
    already the extended length): trained x factor, yarn from its original_max_position_embeddings
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "model_max_length",
                 "max_sequence_length", "max_seq_length", "seq_len")
DEFAULT_MAX_MODEL_LEN = 2048  # a config that names no position limit
ALLOW_LONG = "SPILLWAY_ALLOW_LONG_MAX_MODEL_LEN=1"  # protocol/local/envs.py reads it (and vLLM's name)


@dataclass(frozen=True, slots=True)
class TrainedLength:
    """The longest sequence a model takes, and the config's values it comes from (for messages)."""

    tokens: int
    source: str  # e.g. "max_position_embeddings=8192", "max_position_embeddings=4096 x rope factor 4.0"


def trained_length(config: Mapping) -> TrainedLength:
    """The model's trained context from its config.json's values `config`."""
    limits = {key: config[key] for key in POSITION_KEYS if isinstance(config.get(key), (int, float))}
    if limits:
        key = min(limits, key=limits.__getitem__)
        tokens, source = float(limits[key]), f"{key}={limits[key]}"
    else:
        tokens, source = float(DEFAULT_MAX_MODEL_LEN), f"no position limit in the config, {DEFAULT_MAX_MODEL_LEN}"
    scaling = _rope_scaling(config)
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    # A yarn config without a factor (or null) gets max_position_embeddings / original from
    # transformers: its trained length is then max_position_embeddings, as read above.
    derived = rope_type == "yarn" and scaling.get("factor") is None
    if scaling and rope_type not in ("su", "longrope", "llama3") and not derived:
        factor = float(scaling.get("factor", 1.0))
        if rope_type == "yarn" and "original_max_position_embeddings" in scaling:
            original = scaling["original_max_position_embeddings"]
            tokens, source = float(original), f"rope_scaling original_max_position_embeddings={original}"
        if factor != 1.0:
            tokens, source = tokens * factor, f"{source} x rope factor {factor:g}"
    return TrainedLength(int(tokens), source)


def long_max_model_len_problem(max_model_len: int | None, trained: TrainedLength, allowed: bool,
                               spell: Callable[[str, object], str]) -> str | None:
    """Why `max_model_len` is refused: longer than the model's trained context, unless `allowed`
    (SPILLWAY_ALLOW_LONG_MAX_MODEL_LEN=1); `spell` writes the setting as the caller gave it.
    None when it is taken."""
    if max_model_len is None or max_model_len <= trained.tokens or allowed:
        return None
    return (f"{spell('max_model_len', max_model_len)} is longer than the model's context of {trained.tokens} "
            f"tokens ({trained.source} in its config.json), past which its positions were never trained; "
            f"lower it to {trained.tokens} or less, or set {ALLOW_LONG} (or VLLM_ALLOW_LONG_MAX_MODEL_LEN=1) "
            f"to allow it")


def _rope_scaling(config: Mapping) -> Mapping:
    """`rope_parameters` (transformers 5) when it scales, else `rope_scaling`; {} for neither."""
    params = config.get("rope_parameters") or {}
    if isinstance(params, Mapping) and params.get("rope_type", params.get("type", "default")) != "default":
        return params
    legacy = config.get("rope_scaling") or {}
    return legacy if isinstance(legacy, Mapping) else {}
