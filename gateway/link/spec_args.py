"""vLLM's speculative-decoding arguments, as one `SpeculativeConfig` for the worker.

    --speculative-model M                      a draft model (method draft_model)
    --num-speculative-tokens K                 drafts per step (0 or absent: no speculation)
    --speculative-draft-tensor-parallel-size   1 or --tensor-parallel-size
    --speculative-config JSON                  {"method": "draft_model" | "ngram" | "replay",
                                                "num_speculative_tokens": K, "model": ...,
                                                "prompt_lookup_min": .., "prompt_lookup_max": ..}

The same names are `LLM(...)` arguments (`speculative_config` also as a dict). A value given
both as a flag and in the JSON must agree. The draft model's vocabulary is checked against the
target's when the worker starts (it loads both).
"""

from __future__ import annotations

import json
from collections.abc import Mapping

import msgspec

from spillway.protocol.config import SpeculativeConfig

# The keys --speculative-config takes: SpeculativeConfig's fields, under vLLM's names.
KEYS = tuple(SpeculativeConfig.__struct_fields__)


def speculative_config(*, speculative_model: str | None = None, num_speculative_tokens: int | None = None,
                       speculative_draft_tensor_parallel_size: int | None = None,
                       speculative_config: str | Mapping | None = None,
                       tensor_parallel_size: int = 1) -> SpeculativeConfig | None:
    """The worker's speculative configuration, or None when nothing asks for speculation;
    ValueError naming the bad value otherwise."""
    settings = _parse_json(speculative_config)
    flags = {"model": speculative_model, "num_speculative_tokens": num_speculative_tokens,
             "draft_tensor_parallel_size": speculative_draft_tensor_parallel_size}
    for field, value in flags.items():
        if value is None:
            continue
        if field in settings and settings[field] != value:
            raise ValueError(f"speculative {field} is {value!r} as an argument and {settings[field]!r} "
                             f"in the speculative config")
        settings[field] = value
    if not settings or (settings.keys() <= {"num_speculative_tokens", "draft_tensor_parallel_size"}
                        and settings.get("num_speculative_tokens") in (None, 0)
                        and settings.get("draft_tensor_parallel_size") in (None, 1, tensor_parallel_size)):
        return None  # nothing asks for speculation (vLLM's "0 tokens" included)
    if "method" not in settings:
        if settings.get("model"):
            settings["method"] = "draft_model"
        elif "prompt_lookup_max" in settings or "prompt_lookup_min" in settings:
            settings["method"] = "ngram"
        else:
            raise ValueError("speculative decoding needs a method (draft_model with a speculative model, "
                             "or ngram) in the speculative config")
    if "num_speculative_tokens" not in settings:
        raise ValueError("speculative decoding needs num_speculative_tokens")
    try:
        config = msgspec.convert(settings, SpeculativeConfig)
    except msgspec.ValidationError as exc:
        raise ValueError(f"speculative config: {exc}") from None
    problem = config.problem(tensor_parallel_size)
    if problem is not None:
        raise ValueError(problem)
    return config


def _parse_json(value: str | Mapping | None) -> dict:
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"the speculative config is not JSON: {exc}") from None
    if not isinstance(value, Mapping):
        raise ValueError(f"the speculative config must be a JSON object, got {value!r}")
    unknown = sorted(set(value) - set(KEYS))
    if unknown:
        raise ValueError(f"unknown speculative config keys {unknown}; known: {', '.join(KEYS)}")
    return dict(value)
