"""`spillway serve` as a subprocess for tools/bench/serve/serve.py: the model folder it serves (a
built-in config with the default model's tokenizer, dummy weights), its start, health wait,
CPU time and stop.

The folder needs no download: the tokenizer files come from the default model's converted
folder (`resolve_model(None)`), or from a folder `--export-tokenizer` wrote on a machine that
has the default GGUF, for one that has not.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.metadata
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
# The default model's tokenizer: its vocabulary size and special ids, which the config must share.
TOKENIZER_VOCAB = {"vocab_size": 49152, "bos_token_id": 1, "eos_token_id": 2}


def default_tokenizer_dir() -> Path:
    """The default model's converted folder (converted from its GGUF on first use)."""
    from spillway.protocol.local.model_files import resolve_model

    return resolve_model(None).path


def export_tokenizer(dest: Path, source: Path | None = None) -> list[Path]:
    """Copy the default model's tokenizer files into `dest` (created); returns the copies."""
    source = source or default_tokenizer_dir()
    dest.mkdir(parents=True, exist_ok=True)
    copies = []
    for name in TOKENIZER_FILES:
        if not (source / name).is_file():
            raise FileNotFoundError(f"{source} has no {name}")
        copies.append(Path(shutil.copyfile(source / name, dest / name)))
    return copies


def build_model_folder(config_name: str, tokenizer_dir: Path, dest: Path) -> Path:
    """`dest/config_name/`: the built-in config with the tokenizer's vocabulary, and its files."""
    from spillway.protocol.local.model_files import BUILTIN_CONFIGS_DIR, builtin_config_names

    if config_name not in builtin_config_names():
        raise ValueError(f"no built-in config {config_name!r}: {', '.join(builtin_config_names())}")
    config = json.loads((BUILTIN_CONFIGS_DIR / f"{config_name}.json").read_text())
    config.update(TOKENIZER_VOCAB)
    if config.get("pad_token_id") is not None:
        config["pad_token_id"] = TOKENIZER_VOCAB["eos_token_id"]
    folder = dest / config_name
    export_tokenizer(folder, tokenizer_dir)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


@contextlib.contextmanager
def temporary_model_folder(config_name: str, tokenizer_dir: Path):
    """`build_model_folder` in a temporary directory removed afterwards; yields (folder, vocab size)."""
    tmp = Path(tempfile.mkdtemp(prefix="spillway-bench-"))
    try:
        folder = build_model_folder(config_name, tokenizer_dir, tmp)
        yield folder, json.loads((folder / "config.json").read_text())["vocab_size"]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (not its children: the worker is one)."""
    try:
        import psutil
    except ImportError:
        psutil = None
    if psutil is not None:
        times = psutil.Process(pid).cpu_times()
        return times.user + times.system
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def descendants(pid: int) -> list[int]:
    """The process ids under `pid` (Linux /proc), children first."""
    found = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                children = [int(c) for c in f.read().split()]
        except OSError:
            continue
        for child in children:
            found += [child, *descendants(child)]
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie holds no memory
    except OSError:
        return False


def wait_gone(pids: list[int], timeout_s: float) -> None:
    """Return once none of `pids` runs; TimeoutError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while any(_alive(pid) for pid in pids):
        if time.monotonic() > deadline:
            raise TimeoutError(f"processes {pids} still run after {timeout_s:.0f} s")
        time.sleep(0.1)


def dummy_model_args(folder: Path, flags: list[str], model_name: str) -> list[str]:
    """`spillway serve`'s arguments for `folder` with dummy weights, served as `model_name`."""
    return [str(folder), "--load-format", "dummy", "--served-model-name", model_name, *flags]


def tree_env(tree: Path | None) -> dict[str, str] | None:
    """The environment of a `spillway serve` that runs the source tree at `tree` (a checkout or
    a `git archive`: its gateway, worker, protocol and kernels) instead of the installed
    spillway; None: this process's environment, the installed one."""
    if tree is None:
        return None
    # worker/driver/ since the worker's floors; a baseline from before them has worker/engine.py.
    if not any((tree / "worker" / path).is_file() for path in ("driver/engine.py", "engine.py")):
        raise SystemExit(f"{tree} is not a spillway source tree (no worker/driver/engine.py)")
    site = Path(tempfile.mkdtemp(prefix="spillway-tree-"))
    (site / "spillway").symlink_to(tree.resolve())
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
    return env


PR_SET_PDEATHSIG = 1  # prctl(2)


def parent_death_signal() -> Callable[[], None] | None:
    """A `preexec_fn` that has the child SIGKILLed when the thread that started it ends, the
    process killed outright included (Linux; None elsewhere). A gateway's workers follow it
    (they exit when its pipe closes), so nothing it started outlives the caller."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up before the fork
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def arm() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the parent died before the signal was armed
            os._exit(1)

    return arm


class Server:
    """`spillway serve` with the given arguments, on a free port. `program` is what runs
    `serve ARGS` (default: this interpreter's `spillway.gateway.cli.main`; another engine's CLI
    with the same `serve` flags works too); `env` its environment (`tree_env`: another source
    tree's spillway); `cwd` its working directory; `die_with_parent`: killed when the thread
    that starts it ends (`parent_death_signal`: start it from the main thread)."""

    def __init__(self, serve_args: list[str], startup_timeout_s: float, keep_log: Path | None = None,
                 program: list[str] | None = None, env: dict[str, str] | None = None,
                 cwd: Path | None = None, die_with_parent: bool = False) -> None:
        self.keep_log = keep_log  # the server's output is appended there when it stops
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.TemporaryFile()
        program = program or [sys.executable, "-m", "spillway.gateway.cli.main"]
        command = [*program, "serve", "--port", str(self.port), "--uvicorn-log-level", "warning", *serve_args]
        # Own process group: stopping it reaches the worker even if the gateway hangs.
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
                                        env=env, cwd=cwd,
                                        preexec_fn=parent_death_signal() if die_with_parent else None)
        try:
            self._wait_healthy(startup_timeout_s)
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"spillway serve exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2, trust_env=False).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        raise TimeoutError(f"spillway serve was not healthy within {timeout_s:.0f} s:\n{self.log_tail()}")

    def log_tail(self, chars: int = 4000) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-chars:]

    def cpu_seconds(self) -> float:
        return cpu_seconds(self.process.pid)

    def stop(self) -> None:
        """Stop the gateway and wait for its worker too: the next engine sizes its KV cache
        from the device memory this one leaves free."""
        if self.process.poll() is None:
            children = descendants(self.process.pid)
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(30)
                wait_gone(children, 30)
            except (subprocess.TimeoutExpired, TimeoutError):
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)
                wait_gone(children, 10)
        if self.keep_log is not None and not self.log.closed:
            self.log.seek(0)
            with open(self.keep_log, "ab") as kept:
                kept.write(self.log.read())
        self.log.close()

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


# Engine flags passed to both `spillway serve` and `LLM`: (name, kind).
ENGINE_FLAGS = (("dtype", str), ("kv_cache_dtype", str), ("device", str), ("block_size", int),
                ("max_model_len", int), ("max_num_seqs", int), ("max_num_batched_tokens", int),
                ("gpu_memory_utilization", float), ("num_gpu_blocks_override", int), ("enforce_eager", bool),
                ("async_scheduling", "optional-bool"), ("cpu_offload_gb", float))


def engine_settings(args) -> dict:
    """The engine flags given on the command line, as `LLM` keyword arguments."""
    settings = {}
    for name, kind in ENGINE_FLAGS:
        value = getattr(args, name)
        if value is not None and not (kind is bool and value is False):  # a store_true flag not given
            settings[name] = value
    return settings


def serve_flags(settings: dict) -> list[str]:
    flags = []
    for name, value in settings.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is False:  # an optional-bool flag turned off
            flags.append(flag.replace("--", "--no-", 1))
        else:
            flags += [flag, str(value)]
    return flags


def raise_open_files_limit() -> None:
    """A socket per stream on each side: 1,000 at once pass a soft limit of 1,024. The server,
    started after this, inherits the raised limit."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 65536 if hard == resource.RLIM_INFINITY else min(hard, 65536)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))


def machine() -> str:
    try:
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30).stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        gpu = "no GPU"
    try:
        torch = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch = "?"
    return f"{gpu}, {os.cpu_count()} CPUs, {platform.machine()}, torch {torch}, Python {platform.python_version()}"
