"""Weights of a resolved model folder (protocol/local/model_files.py finds and converts models):
its safetensors files, random weights for load_format "dummy", and its EOS token ids."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

# The worker's one door to model files: resolution and configs are torch-free, shared with the gateway.
from spillway.protocol.local.model_files import ModelFiles, load_config, resolve_model, safetensors_files

if TYPE_CHECKING:
    import torch

__all__ = ["ModelFiles", "eos_token_ids", "init_dummy_weights", "iter_weights", "load_config", "resolve_model"]


# (name, shape) → the index of the part of the tensor to read, or None to skip the tensor.
WeightPart = Callable[[str, list[int]], "tuple[slice, ...] | None"]


def iter_weights(files: ModelFiles, part: WeightPart | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF parameter name, CPU tensor) from the folder's safetensors files.

    `part`: only that part of each tensor (a tensor-parallel rank's slice) is copied out of the
    memory-mapped file, through safetensors' lazy slices; never the whole tensor.
    """
    if files.load_format == "dummy":
        raise ValueError(f"model {files.name!r} has load_format='dummy': it has no weights")
    from safetensors import safe_open

    for weights_file in safetensors_files(files.path):
        with safe_open(weights_file, framework="pt") as f:
            for name in f.keys():
                if part is None:
                    yield name, f.get_tensor(name)
                    continue
                lazy = f.get_slice(name)
                index = part(name, lazy.get_shape())
                if index is not None:
                    yield name, lazy[index]


def init_dummy_weights(model: torch.nn.Module, seed: int = 0) -> None:
    """Fill every parameter in place: norm weights 1, biases 0, the rest normal(0, 0.02).

    Small weights keep activations and logits finite through deep stacks; random ones keep
    the logits from being all equal. One generator per device, seeded with `seed`.
    """
    import torch

    generators: dict[torch.device, torch.Generator] = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            assert not param.is_meta, f"{name} is on the meta device"
            if param.dim() == 1 and "norm" in name:
                param.fill_(1.0)
            elif param.dim() == 1:
                param.zero_()
            else:
                if param.device not in generators:
                    generators[param.device] = torch.Generator(param.device).manual_seed(seed)
                param.normal_(0.0, 0.02, generator=generators[param.device])


def eos_token_ids(files: ModelFiles, hf_config) -> list[int]:
    """EOS ids from the config and, where the folder has one, generation_config.json."""
    ids: list[int] = []
    sources = [getattr(hf_config, "eos_token_id", None)]
    gen_path = files.path / "generation_config.json"
    if gen_path.is_file():
        sources.append(json.loads(gen_path.read_text()).get("eos_token_id"))
    for value in sources:
        for token_id in value if isinstance(value, list) else [value]:
            if isinstance(token_id, int) and token_id not in ids:
                ids.append(token_id)
    return ids
