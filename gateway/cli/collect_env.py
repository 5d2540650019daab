"""`spillway collect-env`: what a bug report needs about this machine, as `vllm collect-env`.

Versions come from the installed packages' metadata, without importing them. What only torch
can tell (CUDA, the GPUs) is asked of a child Python process: an install whose torch fails to
import, or crashes while it does, is reported as such and the rest is still printed; and the
process running the command never imports torch.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import sys

PACKAGES = ("spillway", "torch", "triton", "transformers", "tokenizers", "safetensors", "numpy", "msgspec",
            "pyzmq", "uvicorn", "starlette", "httpx", "gguf")
ENV_PREFIXES = ("SPILLWAY_", "VLLM_", "CUDA_", "NCCL_", "HF_", "TORCH_", "PYTORCH_", "TRITON_")
ENV_NAMES = ("OMP_NUM_THREADS", "TOKENIZERS_PARALLELISM", "TRANSFORMERS_OFFLINE", "LD_LIBRARY_PATH")
SECRET_WORDS = ("KEY", "TOKEN", "SECRET", "PASSWORD")
# The child imports torch and asks CUDA for its devices: seconds, more on a first CUDA start;
# past this bound the report says the probe timed out and goes on without it.
PROBE_TIMEOUT_S = 120.0
# Run in a child process; prints one JSON object.
TORCH_PROBE = """
import json, torch
info = {"torch": torch.__version__, "cuda_build": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
        "gpus": []}
if info["cuda_available"]:
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        info["gpus"].append(f"{index}: {props.name}, {props.total_memory / 2**30:.1f} GiB, "
                            f"compute capability {props.major}.{props.minor}")
print(json.dumps(info))
"""


def add_parser(commands) -> None:
    commands.add_parser("collect-env", help="print this machine's environment for a bug report")


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def torch_info(python: str = sys.executable) -> dict:
    """torch's view of the machine from a child process; {"error": ...} when it fails."""
    try:
        done = subprocess.run([python, "-c", TORCH_PROBE], capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"error": f"importing torch took more than {PROBE_TIMEOUT_S:g} s"}
    except OSError as exc:
        return {"error": str(exc)}
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        return {"error": f"import torch failed: {last}"}
    try:
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"error": f"unexpected output from torch: {done.stdout[-200:]!r}"}


def _nvidia_smi() -> str | None:
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"failed: {exc}"
    return done.stdout.strip() if done.returncode == 0 else f"failed: {done.stderr.strip()[-200:]}"


def environment_variables(environ=os.environ) -> list[tuple[str, str]]:
    """The variables that change what Spillway does, secrets shown only as set."""
    chosen = sorted(name for name in environ if name.startswith(ENV_PREFIXES) or name in ENV_NAMES)
    return [(name, "(set, hidden)" if any(word in name for word in SECRET_WORDS) else environ[name])
            for name in chosen]


def _section(title: str, rows: list[tuple[str, str]]) -> list[str]:
    bar = "=" * 30
    return [bar, f"{title:^30}".rstrip(), bar] + [f"{name:<28} : {value}" for name, value in rows]


def report(torch: dict, environ=os.environ) -> str:
    system = [("OS", platform.platform()), ("Python", f"{platform.python_version()} ({sys.executable})"),
              ("CPU", f"{platform.machine()}, {os.cpu_count()} cores")]
    packages = [(name, _version(name)) for name in PACKAGES]
    if "error" in torch:
        devices = [("PyTorch", torch["error"])]
    else:
        devices = [("PyTorch", torch["torch"]), ("CUDA used to build PyTorch", str(torch["cuda_build"])),
                   ("CUDA available", str(torch["cuda_available"]))]
        devices += [(f"GPU {line.split(':', 1)[0]}", line.split(": ", 1)[1]) for line in torch["gpus"]]
    smi = _nvidia_smi()
    if smi is not None:
        devices.append(("nvidia-smi", smi.replace("\n", "; ")))
    lines = _section("System Info", system) + _section("Packages", packages) + \
        _section("Devices", devices) + _section("Environment Variables", environment_variables(environ) or
                                                [("(none set)", "")])
    return "\n".join(lines)


def run(_args=None) -> int:
    print("Collecting environment information...", flush=True)
    print(report(torch_info()))
    return 0
