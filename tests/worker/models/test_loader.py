"""Model resolution: GGUF conversion and its cache (HF folders: test_model_folders.py; built-in
configs and dummy weights: test_builtin_models.py)."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from spillway.protocol.local import model_cache, model_files
from spillway.protocol.local.model_files import (
    ModelFiles,
    default_model_path,
    load_config,
    load_tokenizer,
    resolve_model,
)
from spillway.worker.models import build_model
from spillway.worker.models.loader import iter_weights
from spillway.worker.models.shard_loading import load_shard
from spillway.worker.models.tensor_parallel import shard_model


@pytest.fixture(scope="module", autouse=True)
def module_cache_dir(tmp_path_factory):
    """Every test here writes to a private cache, never to the user's."""
    with pytest.MonkeyPatch.context() as mp:
        path = tmp_path_factory.mktemp("spillway-cache")
        mp.setenv("SPILLWAY_CACHE_DIR", str(path))
        yield path


@pytest.fixture(scope="module")
def gguf_reference_weights():
    """transformers' own loading of the default GGUF, the reference the conversion is checked
    against. It starts in a thread before the conversion runs (default_files) and takes about
    as long, each mostly in Python on one core: side by side, rather than one after the other.
    Yields a function returning the state dict once loaded."""
    import gguf  # noqa: F401 (imported here, not in two threads at once)
    import transformers.modeling_gguf_pytorch_utils  # noqa: F401
    from transformers import AutoModelForCausalLM, LlamaForCausalLM  # noqa: F401

    loaded: dict[str, object] = {}

    def load() -> None:
        try:
            gguf_path = default_model_path()
            loaded["weights"] = AutoModelForCausalLM.from_pretrained(
                gguf_path.parent, gguf_file=str(gguf_path), dtype=torch.float32, local_files_only=True
            ).state_dict()
        except BaseException as exc:  # raised in the test that asks for the weights
            loaded["error"] = exc

    thread = threading.Thread(target=load, name="gguf-reference", daemon=True)
    thread.start()

    def weights() -> dict[str, torch.Tensor]:
        thread.join()
        if "error" in loaded:
            raise loaded["error"]
        return loaded["weights"]

    yield weights
    thread.join()


@pytest.fixture(scope="module")
def default_files(module_cache_dir, gguf_reference_weights) -> ModelFiles:
    """The default GGUF converted once for the whole module (about 30 s, beside the reference's
    loading)."""
    return resolve_model(None)


@pytest.fixture()
def own_cache_dir(tmp_path, monkeypatch) -> Path:
    path = tmp_path / "cache"
    monkeypatch.setenv("SPILLWAY_CACHE_DIR", str(path))
    return path


def write_folder(path: Path, tensors: dict[str, torch.Tensor] | None = None, **files: str) -> Path:
    """A model folder with the built-in SmolLM2 config, optional weights and extra files."""
    path.mkdir(parents=True, exist_ok=True)
    config = model_files.BUILTIN_CONFIGS_DIR / "smollm2-135m.json"
    (path / "config.json").write_text(config.read_text())
    if tensors is not None:
        save_file(tensors, path / "model.safetensors")
    for name, text in files.items():
        (path / name.replace("__", ".")).write_text(text)
    return path


def fake_converter(calls: list[Path]):
    def convert(gguf_path: Path, dest: Path) -> None:
        calls.append(gguf_path)
        write_folder(dest, {"w": torch.ones(2)})

    return convert


# The default model, converted from GGUF.


@pytest.mark.slow
def test_default_model_becomes_an_hf_folder_in_the_cache(default_files, module_cache_dir):
    assert default_files.name == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert default_files.load_format == "safetensors"
    assert default_files.path.parent == module_cache_dir / "gguf"
    assert len(default_files.path.name) == 32  # xxh3_128 hex digest
    config = json.loads((default_files.path / "config.json").read_text())
    shape = (config["model_type"], config["num_hidden_layers"], config["vocab_size"])
    assert shape == ("llama", 30, 49152)
    assert "quantization_config" not in config
    assert {"model.safetensors", "tokenizer.json", "chat_template.jinja"} <= set(
        p.name for p in default_files.path.iterdir()
    )
    assert not list((module_cache_dir / "gguf").glob(".*.partial"))


@pytest.mark.slow
def test_default_tokenizer_encodes_and_has_a_chat_template(default_files):
    tokenizer = load_tokenizer(default_files)
    assert tokenizer.is_fast
    assert tokenizer.encode("Hello") == [19556]
    assert tokenizer.decode([19556]) == "Hello"
    assert tokenizer.eos_token == "<|im_end|>"
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.slow
def test_default_weights_have_hf_names_and_shapes(default_files):
    config = load_config(default_files)
    assert config.hidden_size == 576
    assert config.num_key_value_heads == 3
    assert config.tie_word_embeddings
    shapes = {name: tuple(tensor.shape) for name, tensor in iter_weights(default_files)}
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (576, 576)
    assert shapes["model.layers.29.self_attn.k_proj.weight"] == (192, 576)
    assert shapes["model.embed_tokens.weight"] == (49152, 576)
    assert "lm_head.weight" not in shapes  # tied to the embedding, as in HF checkpoints
    assert len(shapes) == 2 + 30 * 9


@pytest.mark.slow
def test_converted_weights_equal_transformers_own_gguf_loading(default_files, gguf_reference_weights):
    reference = gguf_reference_weights()
    converted = dict(iter_weights(default_files))
    q_proj = "model.layers.0.self_attn.q_proj.weight"
    assert converted[q_proj].dtype == torch.float32
    assert torch.equal(converted[q_proj], reference[q_proj])
    for name, tensor in converted.items():
        assert torch.equal(tensor, reference[name]), name


@pytest.mark.slow
def test_a_tensor_parallel_rank_loads_its_shard_of_the_converted_gguf(default_files):
    """SmolLM2-135M (9 heads, 3 KV heads) over 3 ranks: rank 1 reads its slices of the converted
    GGUF, and holds exactly what loading the whole model, then `shard_model`, leaves it."""
    config = load_config(default_files)
    whole = build_model(config, device=torch.device("cpu"), dtype=torch.float32)
    whole.load_weights(iter_weights(default_files))
    shard_model(whole, rank=1, world_size=3)
    expected = dict(whole.named_parameters())

    shard = dict(load_shard(config, default_files, 1, 3, device=torch.device("cpu"), dtype=torch.float32)
                 .named_parameters())
    assert shard.keys() == expected.keys()
    assert shard["model.layers.0.self_attn.qkv_proj.weight"].shape == ((3 + 1 + 1) * 64, 576)
    for name, param in shard.items():
        assert torch.equal(param, expected[name]), name


@pytest.mark.slow
@pytest.mark.parametrize("declared", ["TokenizersBackend", "PreTrainedTokenizerFast", "GPT2Tokenizer", "Qwen2Tokenizer",
                                      "LlamaTokenizerFast", "NoSuchTokenizer"])
def test_tokenizer_is_loaded_as_auto_tokenizer_loads_it(default_files, tmp_path, declared):
    """Without AutoTokenizer (its module imports torch), the same class and the same ids."""
    from transformers import AutoTokenizer

    folder = tmp_path / "m"
    folder.mkdir()
    for name in ("config.json", "tokenizer.json", "chat_template.jinja"):
        (folder / name).write_bytes((default_files.path / name).read_bytes())
    tokenizer_config = json.loads((default_files.path / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**tokenizer_config, "tokenizer_class": declared}))
    ours = load_tokenizer(ModelFiles("m", folder, "dummy"))
    theirs = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    assert type(ours) is type(theirs)
    text = "Hello world, <|im_start|> 123  tabs\tand ünïcode 日本"
    assert ours(text)["input_ids"] == theirs(text)["input_ids"]


@pytest.mark.slow
def test_second_resolve_uses_the_cache_and_is_fast(default_files, monkeypatch):
    def fail(*args):
        raise AssertionError("the cache should have answered")

    monkeypatch.setattr(model_cache, "convert_gguf", fail)
    monkeypatch.setattr(model_cache, "_hash_file", fail)  # the index knows the file
    started = time.monotonic()
    again = resolve_model(None)
    assert time.monotonic() - started < 3.0
    assert again == default_files


@pytest.mark.slow
def test_dummy_smollm2_gets_the_gguf_tokenizer():
    files = resolve_model("smollm2-135m", load_format="dummy")
    assert sorted(p.name for p in files.path.iterdir()) == [
        "chat_template.jinja", "config.json", "tokenizer.json", "tokenizer_config.json"
    ]
    assert load_tokenizer(files).encode("Hello") == [19556]
    assert resolve_model(None, load_format="dummy").path == files.path


# The conversion cache, with the converter replaced.


def test_content_hash_is_remembered_until_the_file_changes(own_cache_dir, tmp_path, monkeypatch):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF one")
    hashed: list[Path] = []
    real_hash = model_cache._hash_file
    monkeypatch.setattr(model_cache, "_hash_file", lambda path: hashed.append(path) or real_hash(path))

    first = model_cache.gguf_content_hash(gguf)
    assert model_cache.gguf_content_hash(gguf) == first
    assert len(hashed) == 1
    os.utime(gguf, ns=(0, gguf.stat().st_mtime_ns + 1))
    assert model_cache.gguf_content_hash(gguf) == first
    assert len(hashed) == 2
    gguf.write_bytes(b"GGUF two!")
    assert model_cache.gguf_content_hash(gguf) != first
    assert len(hashed) == 3


def test_gguf_is_converted_once_and_named_as_given(own_cache_dir, tmp_path, monkeypatch):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    calls: list[Path] = []
    monkeypatch.setattr(model_cache, "convert_gguf", fake_converter(calls))
    first = resolve_model(str(gguf))
    second = resolve_model(str(gguf), load_format="gguf")
    assert first == second == ModelFiles(str(gguf), first.path, "safetensors")
    assert calls == [gguf]
    assert [name for name, _ in iter_weights(first)] == ["w"]


def test_interrupted_conversion_leaves_no_cache_folder(own_cache_dir, tmp_path, monkeypatch):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    digest = model_cache.gguf_content_hash(gguf)
    stale = own_cache_dir / "gguf" / f".{digest}.999999999-x.partial"  # a pid that cannot exist
    stale.mkdir()

    def interrupted(gguf_path: Path, dest: Path) -> None:
        (dest / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(model_cache, "convert_gguf", interrupted)
    with pytest.raises(KeyboardInterrupt):
        resolve_model(str(gguf))
    assert sorted(p.name for p in (own_cache_dir / "gguf").iterdir()) == ["index.json"]

    calls: list[Path] = []
    monkeypatch.setattr(model_cache, "convert_gguf", fake_converter(calls))
    files = resolve_model(str(gguf))
    assert files.path == own_cache_dir / "gguf" / digest
    assert calls == [gguf]
