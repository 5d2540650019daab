"""A tensor-parallel rank's shard of a checkpoint, built and loaded without the whole model.

`shard_model` (tensor_parallel.py) cuts a loaded model; here it cuts the model while it is
still on the meta device, so each parameter gets storage at its shard's shape, and each
checkpoint tensor is read as this rank's part only (safetensors' lazy slices), then copied:

    checkpoint tensor            rank r reads
    q_proj, k_proj, v_proj       the rows of its query heads / of its KV heads (a replicated
                                   head's rows on every rank whose query heads read it)
    MLA: q_proj or q_b_proj,     the rows of its query heads (qk_head_dim, nope + v, a head);
      kv_b_proj, o_proj            o_proj's columns of its heads (v_head_dim each); q_a_proj,
                                   kv_a_proj_with_mqa and the latent norms all of it
    gate_proj, up_proj           its rows of the intermediate size (an expert's: of the
                                   expert's; the shared experts': of theirs)
    o_proj, down_proj            the matching input columns; the bias on rank 0 only
    embed_tokens, lm_head        its vocabulary rows, zero rows past the vocabulary
    norms, routers               all of it

Mixtral's experts (w1, w3, w2) are read as gate_proj, up_proj, down_proj. transformers' stacked
expert tensors (a converted GGUF's): down_proj `[E, H, I]` as its columns; gate_up_proj
`[E, 2I, H]` as the rows from the rank's first gate row to its last up row, then cut to those two.

An FP8 checkpoint's tensors are read whole and dequantized (fp8_checkpoint.py) before they
are cut: a tile's scale spans rows of several ranks.

The result equals loading the whole model and then `shard_model`, bit for bit. Random
weights (load_format "dummy") are still generated whole, then cut (executor.load_model): they
must be the same model whatever N.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from spillway.worker.models import loader, model_class_for
from spillway.worker.models.fp8_checkpoint import dequantized_weights, fp8_checkpoint_of
from spillway.worker.models.spec import MlaSpec
from spillway.worker.models.tensor_parallel import ShardLayout, shard_model

_ALL = (slice(None),)
# Mixtral's names of an expert's projections.
_EXPERT_PROJECTIONS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_VOCAB_TABLES = ("embed_tokens", "lm_head")


def load_shard(hf_config, files: loader.ModelFiles, rank: int, world_size: int, *, device: torch.device,
               dtype: torch.dtype) -> nn.Module:
    """Rank `rank` of `world_size`'s shard of the checkpoint in `files`, on `device` in `dtype`.

    Raises ValueError where the sizes do not split over the ranks (before reading anything),
    or, as `load_weights` does, where the checkpoint does not match the config.
    """
    model_class = model_class_for(hf_config)
    with torch.device("meta"):
        whole = model_class(hf_config)  # no storage: only its checkpoint shapes are read
    parts = ShardParts(ShardLayout.plan(whole.spec, rank, world_size), whole.head_dim, whole.checkpoint_shapes(),
                       whole.spec.mla)
    model = model_class.build(hf_config, device=device, dtype=dtype,
                              reshape=partial(shard_model, rank=rank, world_size=world_size))
    checkpoint = fp8_checkpoint_of(hf_config)
    if checkpoint is None:
        weights = dequantized_weights(loader.iter_weights(files, parts.index), None)  # refuses stray fp8
    else:
        # A 128 x 128 tile's scale spans the ranks' rows: read each tensor whole, dequantize, then cut.
        weights = parts.cut(dequantized_weights(loader.iter_weights(files), checkpoint))
    model.load_weights((name, parts.complete(name, tensor)) for name, tensor in weights)
    return model


@dataclass(frozen=True, slots=True)
class ShardParts:
    """Which part of each checkpoint tensor a rank reads; `shapes`: the whole model's
    checkpoint tensors (and transformers' stacked expert tensors), which the checkpoint's must
    match before anything is cut."""

    layout: ShardLayout
    head_dim: int
    shapes: dict[str, tuple[int, ...]]
    mla: MlaSpec | None = None  # an MLA model's dimensions: its heads are cut by these

    def index(self, name: str, shape: list[int]) -> tuple[slice, ...] | None:
        """The index of the part of checkpoint tensor `name` that the rank keeps, None for a
        row-parallel bias off rank 0 (rank 0 adds it once, before the sum)."""
        expected = self.shapes.get(name)
        if expected is not None and tuple(shape) != expected:
            raise ValueError(f"weight {name} has shape {tuple(shape)}, expected {expected}")
        layout = self.layout
        heads = self._heads(self.head_dim)
        projection, kind = _projection_and_kind(name)
        size = self._width(name)
        mla = self.mla
        match _EXPERT_PROJECTIONS.get(projection, projection):
            case "q_proj" | "q_b_proj" if mla is not None:
                return (self._heads(mla.qk_head_dim),)
            case "kv_b_proj":
                return (self._heads(mla.qk_nope_head_dim + mla.v_head_dim),)
            case "o_proj" if mla is not None and kind == "weight":
                return (slice(None), self._heads(mla.v_head_dim))
            case "q_proj":
                return (heads,)
            case "k_proj" | "v_proj":
                return (_rows(layout.first_kv_head * self.head_dim, layout.num_kv_heads * self.head_dim),)
            case "gate_proj" | "up_proj":
                return (_rows(layout.rank * size, size),)
            case "o_proj" | "down_proj" if kind == "bias":
                return _ALL if layout.rank == 0 else None
            case "o_proj":
                return (slice(None), heads)
            case "down_proj":
                return (slice(None), _rows(layout.rank * size, size))
            case "experts" if kind == "down_proj":
                return (slice(None), slice(None), _rows(layout.rank * size, size))
            case "experts" if kind == "gate_up_proj":  # from its first gate row to its last up row
                full_size = shape[1] // 2
                return (slice(None), slice(layout.rank * size, full_size + (layout.rank + 1) * size))
            case "embed_tokens" | "lm_head":
                start = min(layout.first_vocab_row, shape[0])  # the last ranks may hold only padding
                return (slice(start, min(start + layout.vocab_rows, shape[0])),)
            case _:
                return _ALL

    def _heads(self, per_head: int) -> slice:
        """The rows of the rank's query heads in a tensor of `per_head` rows a head."""
        return _rows(self.layout.first_head * per_head, self.layout.num_heads * per_head)

    def cut(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The rank's part of each whole tensor of `weights`, as `index` says."""
        for name, tensor in weights:
            index = self.index(name, list(tensor.shape))
            if index is not None:
                yield name, tensor[index]

    def complete(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The rank's part as its parameter holds it, from what `index` read: vocabulary slices
        padded, a stacked gate_up_proj's span cut to the rank's gate and up rows."""
        if name.endswith(".experts.gate_up_proj"):
            size = self.layout.expert_intermediate_size
            return torch.cat([tensor[:, :size], tensor[:, -size:]], dim=1)
        return self.pad_vocab(name, tensor)

    def _width(self, name: str) -> int:
        """The rank's slice of the intermediate size that tensor `name` is cut along."""
        if ".experts." in name:
            return self.layout.expert_intermediate_size
        if ".shared_experts." in name:
            return self.layout.shared_expert_intermediate_size
        return self.layout.intermediate_size

    def pad_vocab(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A vocabulary slice padded with zero rows to the shard's `vocab_rows` (on the CPU,
        slice-sized); any other tensor as it is."""
        rows = self.layout.vocab_rows
        if _projection_and_kind(name)[0] not in _VOCAB_TABLES or tensor.shape[0] == rows:
            return tensor
        padded = tensor.new_zeros(rows, *tensor.shape[1:])
        padded[: tensor.shape[0]] = tensor
        return padded


def _projection_and_kind(name: str) -> tuple[str, str]:
    """`("q_proj", "weight")` for "model.layers.0.self_attn.q_proj.weight"."""
    return tuple(([""] + name.rsplit(".", 2))[-2:])


def _rows(start: int, length: int) -> slice:
    return slice(start, start + length)
