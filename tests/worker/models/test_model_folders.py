"""Model resolution of HF folders: sharded safetensors, refused formats, dummy weights, the local
Hugging Face cache, and the models that cannot be resolved (GGUF: test_loader.py)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from tests.worker.models.test_loader import module_cache_dir, write_folder  # noqa: F401 (an autouse fixture: a private cache)

from spillway.protocol.local.model_files import ModelFiles, resolve_model
from spillway.worker.models.loader import iter_weights


def test_sharded_folder_yields_the_indexed_shards_only(tmp_path):
    folder = write_folder(tmp_path / "m")
    save_file({"a": torch.zeros(2)}, folder / "model-00001-of-00002.safetensors")
    save_file({"b": torch.ones(3)}, folder / "model-00002-of-00002.safetensors")
    save_file({"stale": torch.ones(1)}, folder / "consolidated.safetensors")
    shards = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
    index = {"metadata": {"total_size": 20}, "weight_map": shards}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    files = resolve_model(str(folder))
    assert files == ModelFiles(str(folder), folder, "safetensors")
    weights = {name: t.tolist() for name, t in iter_weights(files)}
    assert weights == {"a": [0.0, 0.0], "b": [1.0, 1.0, 1.0]}


def test_folder_with_only_bin_weights_is_refused(tmp_path):
    folder = write_folder(tmp_path / "m", pytorch_model__bin="not a pickle")
    with pytest.raises(ValueError, match=r"\.bin.*safetensors"):
        resolve_model(str(folder))


def test_folder_without_weights_needs_dummy(tmp_path):
    folder = write_folder(tmp_path / "m")
    with pytest.raises(ValueError, match="dummy"):
        resolve_model(str(folder))
    files = resolve_model(str(folder), load_format="dummy")
    assert files == ModelFiles(str(folder), folder, "dummy")
    with pytest.raises(ValueError, match="no weights"):
        next(iter_weights(files))


def test_hub_model_already_in_the_local_hf_cache_resolves(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--acme--tiny"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = write_folder(repo / "snapshots" / commit, {"w": torch.ones(1)})
    assert resolve_model("acme/tiny") == ModelFiles("acme/tiny", snapshot, "safetensors")


@pytest.mark.parametrize(
    ("model", "load_format", "message"),
    [
        ("/no/such/folder", "auto", "not found.*never downloads"),
        ("meta-llama/Llama-3-8B", "auto", "'meta-llama/Llama-3-8B' not found.*never downloads"),
        ("qwen3-8b", "auto", "load_format='dummy'"),
        (None, "pt", "load_format must be one of"),
        (None, "safetensors", "is a GGUF file"),
    ],
)
def test_unresolvable_models_raise_value_error(model, load_format, message, tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-hub"))
    with pytest.raises(ValueError, match=message):
        resolve_model(model, load_format=load_format)


def test_non_gguf_file_and_folder_without_config_are_refused(tmp_path):
    (tmp_path / "weights.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="not a .gguf file"):
        resolve_model(str(tmp_path / "weights.safetensors"))
    (tmp_path / "m.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match=r"no config.json; pass the .gguf file itself \(m.gguf\)"):
        resolve_model(str(tmp_path))
