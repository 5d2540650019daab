"""Tile configurations of the fused mixture-of-experts kernels, per shape, GPU and token count.

A tuned table is a JSON file in `kernels/moe_configs/`, written by
tools/bench/kernels/tune_moe.py on the GPU it names, for one expert count E, expert width I
(w13 is `[E, 2I, H]`) and dtype:

    experts128-width768-NVIDIA_H200-bf16.json
    {"shape": {...what it was tuned on...}, "tuned_with": "...",
     "buckets": {"1": {"path": "pairs", "BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 32, ...}, "2": ...}}

Experts with float8 e4m3 weights (and bf16 activations) have tables of their own,
`experts128-width768-NVIDIA_H200-bf16-fp8weights.json`: a tile reads half the bytes, so the
fastest tiles differ from the unquantized experts'.

A call with T tokens takes the bucket nearest T (by ratio: 3 takes 4 over 2, ties take the
smaller). A shape without a table gets `default_config`, and one log line per shape. Tables
are read once per shape and their configs are shared objects, so a step never re-reads a
file and the kernels see the same constants for every T of a bucket (no recompilation).

`path` picks the kernels: "pairs" (kernels/moe_pairs.py: one program per token-expert pair,
no sorting; small batches) or "grouped" (kernels/moe_align.py + kernels/moe_grouped.py:
pairs sorted by expert, tensor-core products over blocks of BLOCK_SIZE_M rows).
"""

from __future__ import annotations

import functools
import json
import logging
import math
import re
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

CONFIG_DIR = Path(__file__).resolve().parent / "moe_configs"
PATHS = ("pairs", "grouped")
_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
_JSON_KEYS = {"block_size_m": "BLOCK_SIZE_M", "block_size_n": "BLOCK_SIZE_N", "block_size_k": "BLOCK_SIZE_K",
              "group_size_m": "GROUP_SIZE_M", "num_warps": "num_warps", "num_stages": "num_stages"}


@dataclass(frozen=True, slots=True)
class MoeConfig:
    """One launch setting. The pairs path tiles columns by block_size_n and the reduction by
    block_size_k and ignores block_size_m and group_size_m; the grouped path uses all of them
    (group_size_m: blocks whose programs run side by side on one column tile, for L2 reuse)."""

    path: str
    block_size_m: int = 16
    block_size_n: int = 64
    block_size_k: int = 64
    group_size_m: int = 1
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        if self.path not in PATHS:
            raise ValueError(f"path must be one of {PATHS}, got {self.path!r}")
        for name in ("block_size_m", "block_size_n", "block_size_k", "num_warps"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value > 0 and value & (value - 1) == 0):
                raise ValueError(f"{name} must be a power of two, got {value!r}")
        if self.path == "grouped" and min(self.block_size_m, self.block_size_n, self.block_size_k) < 16:
            raise ValueError(f"the grouped path's tiles must be at least 16 (tensor-core products), got {self}")
        if self.group_size_m < 1 or self.num_stages < 1:
            raise ValueError(f"group_size_m and num_stages must be positive, got {self}")

    def to_json(self) -> dict:
        fields = asdict(self)
        return {"path": fields.pop("path"), **{_JSON_KEYS[name]: value for name, value in fields.items()}}

    @classmethod
    def from_json(cls, entry: dict) -> MoeConfig:
        names = {json_key: name for name, json_key in _JSON_KEYS.items()}
        unknown = set(entry) - set(names) - {"path"}
        if unknown:
            raise ValueError(f"unknown keys in a MoE config: {sorted(unknown)}")
        return cls(path=entry.get("path", "grouped"), **{names[key]: value for key, value in entry.items()
                                                          if key != "path"})


def dtype_name(dtype: torch.dtype) -> str:
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"no MoE config naming for dtype {dtype}")
    return _DTYPE_NAMES[dtype]


def config_file_name(num_experts: int, intermediate: int, device_name: str, dtype: torch.dtype,
                     weight_dtype: torch.dtype | None = None) -> str:
    """`experts{E}-width{I}-{device}-{dtype}.json`, the device's name with every run of
    characters other than letters, digits and dots as one underscore ("NVIDIA H200" -> NVIDIA_H200);
    `-fp8weights` before `.json` where the weights are float8 e4m3 (`weight_dtype`, else `dtype`)."""
    device = re.sub(r"[^A-Za-z0-9.]+", "_", device_name).strip("_")
    weights = weight_suffix(weight_dtype or dtype, dtype)
    return f"experts{num_experts}-width{intermediate}-{device}-{dtype_name(dtype)}{weights}.json"


def weight_suffix(weight_dtype: torch.dtype, dtype: torch.dtype) -> str:
    """What a table's name adds for experts whose weights are not in the activations' dtype."""
    if weight_dtype == dtype:
        return ""
    if weight_dtype != torch.float8_e4m3fn:
        raise ValueError(f"no MoE config naming for {weight_dtype} weights under {dtype} activations")
    return "-fp8weights"


def read_buckets(path: Path) -> dict[int, MoeConfig]:
    """A tuned table's token buckets."""
    table = json.loads(Path(path).read_text())
    buckets = {int(tokens): MoeConfig.from_json(entry) for tokens, entry in table["buckets"].items()}
    if not buckets or min(buckets) < 1:
        raise ValueError(f"{path}: buckets must be positive token counts, got {sorted(buckets)}")
    return buckets


@functools.lru_cache(maxsize=None)
def tuned_buckets(num_experts: int, intermediate: int, device_name: str, dtype: torch.dtype,
                  directory: Path = CONFIG_DIR, weight_dtype: torch.dtype | None = None
                  ) -> dict[int, MoeConfig] | None:
    """The table shipped for this shape, or None (said once per shape in the log)."""
    path = Path(directory) / config_file_name(num_experts, intermediate, device_name, dtype, weight_dtype)
    if path.is_file():
        return read_buckets(path)
    weights = "" if weight_dtype in (None, dtype) else ", fp8 weights"
    logger.warning("no tuned MoE config %s: default tiles for E=%d, I=%d on %s (%s%s); "
                   "tools/bench/kernels/tune_moe.py writes one", path.name, num_experts, intermediate,
                   device_name, dtype_name(dtype), weights)
    return None


def nearest_bucket(buckets, num_tokens: int) -> int:
    """The bucket nearest `num_tokens` by ratio; ties go to the smaller."""
    target = math.log2(max(num_tokens, 1))
    return min(sorted(buckets), key=lambda bucket: abs(math.log2(bucket) - target))


def default_config(num_tokens: int, num_experts: int, top_k: int, dtype: torch.dtype) -> MoeConfig:
    """Untuned tiles: the pairs path while experts get about one pair each (each pair's
    product reads its expert's weights; a shared one comes from L2), the grouped path with
    blocks sized to the pairs an expert gets beyond that."""
    pairs_per_expert = num_tokens * top_k / num_experts
    if pairs_per_expert <= 1:
        # Long rows (16 x 512 a tile, 8 warps): a token's down program is one of only H / 16.
        return MoeConfig("pairs", block_size_n=16, block_size_k=512, num_warps=8, num_stages=2)
    wide = dtype != torch.float32  # float32 tiles take twice the shared memory a stage
    block_m = min(128 if wide else 64, max(16, 1 << math.ceil(math.log2(pairs_per_expert))))
    block_n = 128 if block_m >= 64 and wide else 64
    return MoeConfig("grouped", block_size_m=block_m, block_size_n=block_n, block_size_k=64, group_size_m=8,
                     num_warps=8 if block_m * block_n >= 128 * 128 else 4, num_stages=3 if wide else 2)


def config_for(num_experts: int, intermediate: int, top_k: int, device_name: str, dtype: torch.dtype,
               num_tokens: int, directory: Path = CONFIG_DIR, weight_dtype: torch.dtype | None = None) -> MoeConfig:
    """The tuned config of the bucket nearest `num_tokens`, else `default_config`; `dtype` is the
    activations', `weight_dtype` the experts' weights' (default: `dtype`)."""
    buckets = tuned_buckets(num_experts, intermediate, device_name, dtype, directory, weight_dtype)
    if buckets is None:
        return _default_config(num_tokens, num_experts, top_k, dtype)
    return buckets[nearest_bucket(buckets, num_tokens)]


# Defaults are built once per argument set, so each T reuses one object as tuned tables do.
_default_config = functools.lru_cache(maxsize=4096)(default_config)


@functools.lru_cache(maxsize=None)
def device_name(device: torch.device) -> str:
    """The name configs are filed under: the CUDA device's (e.g. "NVIDIA H200"), else the device
    type. Asked once per device: an eager step calls it in every MoE layer."""
    if device.type != "cuda":
        return device.type
    return torch.cuda.get_device_name(device)
