"""`python -m spillway.worker.models.gguf_convert model|tokenizer GGUF DEST`: the torch side of
the model cache (protocol/local/model_cache.py runs it as a child, so its caller never imports torch).

    model:     DEST gets config.json, generation_config.json, the tokenizer and model.safetensors
               (float32; transformers undoes llama.cpp's Q/K order while dequantising; a
               mixture of experts keeps transformers' stacked expert tensors; a Mixtral, which
               transformers reads as a dense Llama, gets its experts from the file here)
    tokenizer: DEST gets the tokenizer files and chat template only
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Iterator
from pathlib import Path

import torch


@contextlib.contextmanager
def parsed_once() -> Iterator[None]:
    """Within the block, every `gguf.GGUFReader` of one file is the same object, and gguf's
    tensor-name maps are built once per architecture and depth. transformers (5.25) opens the
    file anew for the config, the weights and the tokenizer, and each opening parses every
    header field (SmolLM2's 49,152-token vocabulary and its merges: about 5 s on one core), and
    it builds a name map for each of the file's tensors (12 ms each); a conversion took 23 s of
    which 2 s were the weights. Both are looked up in gguf's module when called, so setting them
    there reaches every caller; they are put back after the block."""
    import gguf

    readers: dict[tuple[Path, str], object] = {}
    reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map

    def shared_reader(path, mode: str = "r"):
        key = (Path(path).resolve(), mode)
        if key not in readers:
            readers[key] = reader_class(path, mode)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = shared_reader, functools.cache(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader_class, name_map


def convert_model(gguf_path: Path, dest: Path) -> None:
    with parsed_once():
        _convert_model(gguf_path, dest)


def _convert_model(gguf_path: Path, dest: Path) -> None:
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    import gguf

    header = gguf.GGUFReader(gguf_path).fields
    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=str(gguf_path), dtype=torch.float32, local_files_only=True,
        **_config_transformers_misses(header),
    )
    if _lost_experts(header, model):
        model = _mixtral_with_experts(gguf_path, header, model)
    config = model.config
    if hasattr(config, "quantization_config"):  # the saved weights are plain float32
        del config.quantization_config
    config.architectures = [type(model).__name__]
    config.save_pretrained(dest)
    model.generation_config.save_pretrained(dest)
    _save_tokenizer(gguf_path, dest)
    save_file(_unshared(model.state_dict()), dest / "model.safetensors", metadata={"format": "pt"})


def _value(header, key: str):
    """The value of a GGUF header field, None where the file has no such key."""
    field = header.get(key)
    return None if field is None else field.contents()


def _config_transformers_misses(header) -> dict[str, int]:
    """Config values in the GGUF header that transformers (5.25) does not read: Qwen3-MoE's
    expert width, which it would leave at Qwen3MoeConfig's default (768, Qwen3-30B-A3B's) and
    then refuse every other model's expert tensors."""
    width = _value(header, "qwen3moe.expert_feed_forward_length")
    return {} if width is None else {"moe_intermediate_size": int(width)}


def _lost_experts(header, model) -> bool:
    """Whether the file holds experts that transformers' model lacks: (5.25) reads llama.cpp's
    Mixtral (architecture "llama" with experts) as a dense Llama whose MLPs it leaves random,
    with a warning only."""
    architecture = _value(header, "general.architecture")
    num_experts = _value(header, f"{architecture}.expert_count") or 0
    return bool(num_experts) and not any(".experts." in name for name, _ in model.named_parameters())


def _mixtral_with_experts(gguf_path: Path, header, dense):
    """A MixtralForCausalLM of the dense model's attention, norms, embedding and head (their
    Q/K order already undone) and the file's routers and experts, dequantised to float32:
    llama.cpp's stacked `blk.N.ffn_{gate,up,down}_exps` or, in older files, one tensor an
    expert (`blk.N.ffn_gate.E`)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    architecture = _value(header, "general.architecture")
    if architecture != "llama":
        raise ValueError(f"{gguf_path}: transformers dropped the experts of GGUF architecture {architecture!r}, "
                         "which only a Mixtral (\"llama\") file gets back here; give the model's Hugging Face folder")
    num_experts = int(_value(header, "llama.expert_count"))
    known = MixtralConfig().to_dict()
    settings = {key: value for key, value in dense.config.to_dict().items() if key in known}
    settings.pop("model_type", None)
    settings.update(num_local_experts=num_experts, num_experts_per_tok=int(_value(header, "llama.expert_used_count")))
    tensors = _gguf_tensor_reader(gguf_path)
    state = {name: tensor for name, tensor in dense.state_dict().items() if ".mlp." not in name}
    for layer in range(dense.config.num_hidden_layers):
        ours = f"model.layers.{layer}.mlp."
        gate, up, down = (_experts_tensor(tensors, layer, part, num_experts) for part in ("gate", "up", "down"))
        state[ours + "gate.weight"] = tensors(f"blk.{layer}.ffn_gate_inp.weight")
        state[ours + "experts.gate_up_proj"] = torch.cat([gate, up], dim=1)
        state[ours + "experts.down_proj"] = down
    settings["intermediate_size"] = state["model.layers.0.mlp.experts.down_proj"].shape[2]
    config = MixtralConfig(**settings)
    with torch.device("meta"):
        model = MixtralForCausalLM(config)
    model.load_state_dict(state, strict=True, assign=True)
    model.generation_config = dense.generation_config
    if config.tie_word_embeddings:
        model.tie_weights()
    return model.float()


def _gguf_tensor_reader(gguf_path: Path):
    """name -> float32 torch tensor in torch's order (GGUF lists dimensions the other way)."""
    import gguf
    from gguf.quants import dequantize

    by_name = {tensor.name: tensor for tensor in gguf.GGUFReader(gguf_path).tensors}

    def read(name: str) -> torch.Tensor:
        if name not in by_name:
            raise ValueError(f"{gguf_path} has no tensor {name!r}")
        tensor = by_name[name]
        values = dequantize(tensor.data, tensor.tensor_type).reshape(tuple(int(d) for d in reversed(tensor.shape)))
        return torch.from_numpy(values.astype("float32", copy=True))

    read.names = by_name
    return read


def _experts_tensor(read, layer: int, part: str, num_experts: int) -> torch.Tensor:
    """`[E, rows, columns]` of one projection of every expert of a layer."""
    stacked = f"blk.{layer}.ffn_{part}_exps.weight"
    if stacked in read.names:
        return read(stacked)
    return torch.stack([read(f"blk.{layer}.ffn_{part}.{expert}.weight") for expert in range(num_experts)])


def save_tokenizer(gguf_path: Path, dest: Path) -> None:
    with parsed_once():
        _save_tokenizer(gguf_path, dest)


def _save_tokenizer(gguf_path: Path, dest: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=str(gguf_path), local_files_only=True)
    tokenizer.save_pretrained(dest)


def _unshared(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop tensors that alias an earlier one (tied lm_head), as HF checkpoints do."""
    seen: set[tuple[int, tuple[int, ...]]] = set()
    result = {}
    for name, tensor in state_dict.items():
        key = (tensor.data_ptr(), tuple(tensor.shape))
        if key not in seen:
            seen.add(key)
            result[name] = tensor.contiguous()
    return result


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[0] not in ("model", "tokenizer"):
        print("usage: python -m spillway.worker.models.gguf_convert model|tokenizer GGUF DEST", file=sys.stderr)
        return 2
    what, gguf_path, dest = argv[0], Path(argv[1]), Path(argv[2])
    (convert_model if what == "model" else save_tokenizer)(gguf_path, dest)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
