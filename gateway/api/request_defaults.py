"""What a request gets for the fields it leaves out, and the server's limit on logprobs.

`--generation-config auto` (vLLM's default) takes sampling defaults from the model's
generation_config.json, as vLLM does: temperature, top_p, top_k, min_p, repetition_penalty,
and max_new_tokens as the default max_tokens. `vllm` takes none; a folder takes its file.
A request's own values always win.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from pathlib import Path

import msgspec

from spillway.gateway.api import openai as api
from spillway.gateway.api.sampling_params import MAX_LOGPROBS

# generation_config.json key -> request field
_SAMPLING_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                  "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


@dataclass(frozen=True, slots=True)
class RequestDefaults:
    """Defaults for the sampling fields a request leaves out (None: the API's own)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None  # the completion's length when the request gives none
    max_logprobs: int = MAX_LOGPROBS

    def apply(self, request):
        """`request` (a msgspec Struct) with the defaults in the sampling fields it left out."""
        changes = {name: getattr(self, name) for name in ("temperature", "top_p", "top_k", "min_p",
                                                          "repetition_penalty")
                   if getattr(request, name) is None and getattr(self, name) is not None}
        return msgspec.structs.replace(request, **changes) if changes else request

    def check_logprobs(self, logprobs: int | None, param: str) -> None:
        """A 400 for more logprobs than `--max-logprobs` allows."""
        if logprobs is not None and logprobs > self.max_logprobs:
            raise api.bad_request(f"{param} must be at most {self.max_logprobs} (this server's --max-logprobs), "
                                  f"got {logprobs}", param=param)

    @property
    def overridden(self) -> dict[str, float | int]:
        """The defaults taken from a generation config, for the start-up log."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name != "max_logprobs" and getattr(self, f.name) is not None}


def read_request_defaults(generation_config: str, model_folder: Path, max_logprobs: int = MAX_LOGPROBS
                          ) -> RequestDefaults:
    """The defaults `--generation-config` names (ValueError for a folder or file that is not
    there or not valid)."""
    if generation_config == "vllm":
        return RequestDefaults(max_logprobs=max_logprobs)
    if generation_config == "auto":
        path = model_folder / "generation_config.json"
        if not path.is_file():
            return RequestDefaults(max_logprobs=max_logprobs)
    else:
        path = Path(generation_config).expanduser() / "generation_config.json"
        if not path.is_file():
            raise ValueError(f"--generation-config {generation_config}: no generation_config.json in that folder")
    try:
        values = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"--generation-config: cannot read {path}: {exc}") from None
    if not isinstance(values, dict):
        raise ValueError(f"--generation-config: {path} does not hold a JSON object")
    return RequestDefaults(max_logprobs=max_logprobs, **{
        field: _number(values[key], key, path) for key, field in _SAMPLING_KEYS.items() if values.get(key) is not None})


def _number(value: object, key: str, path: Path) -> float | int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"--generation-config: {key} in {path} must be a number, got {value!r}")
    if key in ("top_k", "max_new_tokens") and value != int(value):
        raise ValueError(f"--generation-config: {key} in {path} must be an integer, got {value!r}")
    return int(value) if key in ("top_k", "max_new_tokens") else float(value)
