"""The on-disk model cache: GGUF files dequantised once into HF folders, built atomically.

`model_files.resolve_model` decides what goes where (see its module docstring); this module does
the work: the content hash of a GGUF file (remembered by path, size and mtime), the
conversion, and `building`, which publishes a folder only once it is complete.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import xxhash

from spillway.protocol.local import envs


def gguf_content_hash(gguf_path: Path) -> str:
    """xxh3_128 of the file's bytes, remembered by (absolute path, size, mtime_ns)."""
    gguf_path = gguf_path.resolve()
    stat = gguf_path.stat()
    key = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    index_path = envs.cache_dir() / "gguf" / "index.json"
    try:
        index = json.loads(index_path.read_text())
    except (OSError, ValueError):
        index = {}
    entry = index.get(str(gguf_path))
    if isinstance(entry, dict) and {k: entry.get(k) for k in key} == key:
        return entry["xxh3_128"]
    digest = _hash_file(gguf_path)
    index[str(gguf_path)] = {**key, "xxh3_128": digest}
    index_path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=index_path.parent, delete=False) as f:
        json.dump(index, f, indent=1)
    os.chmod(f.name, 0o644)
    os.replace(f.name, index_path)
    return digest


def _hash_file(path: Path) -> str:
    hasher = xxhash.xxh3_128()
    with path.open("rb") as f:
        while chunk := f.read(1 << 24):
            hasher.update(chunk)
    return hasher.hexdigest()


def convert_gguf(gguf_path: Path, dest: Path) -> None:
    """Dequantise a GGUF file into an HF folder (config, generation config, tokenizer, float32
    model.safetensors), in a child interpreter: the conversion needs torch, this process may not."""
    _run_converter("model", gguf_path, dest)


def save_gguf_tokenizer(gguf_path: Path, dest: Path) -> None:
    """Write the GGUF file's tokenizer (and chat template) into `dest`, in a child interpreter."""
    _run_converter("tokenizer", gguf_path, dest)


def _run_converter(what: str, gguf_path: Path, dest: Path) -> None:
    # Run in `dest`: `-m` puts the working directory on the child's sys.path, and run from a
    # checkout's root its kernels/ folder would pass for the `kernels` package transformers seeks.
    command = [sys.executable, "-m", "spillway.worker.models.gguf_convert", what,
               str(gguf_path.absolute()), str(dest.absolute())]
    result = subprocess.run(command, stdin=subprocess.DEVNULL, cwd=dest)
    if result.returncode != 0:
        raise ValueError(f"converting {gguf_path} failed (exit code {result.returncode}; its error is above)")


@contextlib.contextmanager
def building(folder: Path, replace: bool) -> Iterator[Path]:
    """Yield a temporary folder beside `folder`, renamed to `folder` once the block succeeds.

    If `folder` appeared meanwhile (another process built it), `replace` says whether ours
    takes its place or is dropped. Temporary names carry the builder's pid, so leftovers of a
    killed build are removed by the next build on this host.
    """
    folder.parent.mkdir(parents=True, exist_ok=True)
    prefix = f".{folder.name}."
    for stale in folder.parent.glob(f"{prefix}*.partial"):
        if not _pid_alive(stale.name[len(prefix):-len(".partial")]):
            shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", suffix=".partial",
                                dir=folder.parent))
    tmp.chmod(0o755)  # mkdtemp's 0700 would hide a shared cache from other users
    try:
        yield tmp
        if replace and folder.exists():
            old = folder.parent / f"{prefix}{os.getpid()}-old.partial"
            with contextlib.suppress(FileNotFoundError):
                os.replace(folder, old)
                shutil.rmtree(old, ignore_errors=True)
        try:
            os.replace(tmp, folder)
        except OSError:
            if not folder.is_dir():  # else another process published it first: keep theirs
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _pid_alive(tag: str) -> bool:
    pid = tag.split("-", 1)[0]
    if not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
