"""`python -m spillway.worker.models.gguf_convert model|tokenizer GGUF DEST`: the torch side of
the model cache (protocol/local/model_cache.py runs it as a child, so its caller never imports torch).

    model:     DEST gets config.json, generation_config.json, the tokenizer and model.safetensors
               (float32; transformers undoes llama.cpp's Q/K order while dequantising; a
               mixture of experts keeps transformers' stacked expert tensors)
    tokenizer: DEST gets the tokenizer files and chat template only
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch


def convert_model(gguf_path: Path, dest: Path) -> None:
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from gguf import GGUFReader

    header = GGUFReader(gguf_path).fields  # memory-mapped: only the values asked for are read
    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=str(gguf_path), dtype=torch.float32, local_files_only=True,
        **_config_transformers_misses(header),
    )
    _refuse_lost_experts(gguf_path, header, model)
    config = model.config
    del config.quantization_config  # the saved weights are plain float32
    config.architectures = [type(model).__name__]
    config.save_pretrained(dest)
    model.generation_config.save_pretrained(dest)
    save_tokenizer(gguf_path, dest)
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


def _refuse_lost_experts(gguf_path: Path, header, model) -> None:
    """transformers (5.25) reads llama.cpp's Mixtral (architecture "llama" with experts) as a
    dense Llama: it drops the experts and leaves the MLPs random, with a warning only."""
    architecture = _value(header, "general.architecture")
    num_experts = _value(header, f"{architecture}.expert_count") or 0
    if num_experts and not any(".experts." in name for name, _ in model.named_parameters()):
        import transformers

        raise ValueError(
            f"{gguf_path} holds a mixture of {num_experts} experts (GGUF architecture {architecture!r}) that "
            f"transformers {transformers.__version__} converts to a dense {type(model).__name__} without them; "
            "give the model's Hugging Face folder instead"
        )


def save_tokenizer(gguf_path: Path, dest: Path) -> None:
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
