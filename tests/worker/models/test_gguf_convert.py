"""The GGUF converter parses a file once however often transformers opens it."""

from __future__ import annotations

import gguf
from tiny_gguf import write_qwen3_moe_gguf
from tiny_models import tiny_qwen3_moe

from spillway.worker.models import gguf_convert


def test_a_conversion_parses_the_file_once_and_puts_gguf_back(tmp_path, monkeypatch):
    opened = []
    original = gguf.GGUFReader

    class CountingReader(original):
        def __init__(self, path, mode="r"):
            opened.append(path)
            super().__init__(path, mode)

    monkeypatch.setattr(gguf, "GGUFReader", CountingReader)
    name_map = gguf.get_tensor_name_map
    path = write_qwen3_moe_gguf(tiny_qwen3_moe(mlp_only_layers=()), tmp_path / "tiny.gguf")
    dest = tmp_path / "out"
    dest.mkdir()
    gguf_convert.convert_model(path, dest)
    # transformers opens it for the config, the weights and the tokenizer, the converter for its header.
    assert len(opened) == 1
    assert {p.name for p in dest.iterdir()} >= {"config.json", "model.safetensors", "tokenizer.json"}
    assert gguf.GGUFReader is CountingReader and gguf.get_tensor_name_map is name_map
    with gguf_convert.parsed_once():
        assert gguf.GGUFReader(path) is gguf.GGUFReader(str(path))
        assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2) is gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)
    assert gguf.GGUFReader is CountingReader
