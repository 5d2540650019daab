"""`spillway --version` and `spillway collect-env`, and what the command line imports: the new
commands' modules wait until they run, so `spillway serve` loads none of them."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys

from server_helpers import spillway_command
from spillway.gateway.cli.collect_env import report, torch_info


def spillway(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*spillway_command(), *argv], capture_output=True, text=True, timeout=300, env=env)


def test_version_prints_the_installed_version():
    for flag in ("--version", "-v"):
        done = spillway(flag)
        assert (done.returncode, done.stdout, done.stderr) == (0, importlib.metadata.version("spillway") + "\n", "")


def test_collect_env_reports_versions_devices_and_settings_but_no_secret():
    env = {**os.environ, "SPILLWAY_WORKER_KEY": "do-not-print-me", "SPILLWAY_SOME_SETTING": "7",
           "CUDA_VISIBLE_DEVICES": ""}  # no GPU, on any machine
    done = spillway("collect-env", env=env)
    assert done.returncode == 0, done.stderr
    rows = {name.strip(): value.strip() for name, sep, value in
            (line.partition(" : ") for line in done.stdout.splitlines()) if sep}
    assert done.stdout.startswith("Collecting environment information...\n")
    assert rows["spillway"] == importlib.metadata.version("spillway")
    assert rows["transformers"] == importlib.metadata.version("transformers")
    assert rows["PyTorch"] == importlib.metadata.version("torch")
    assert rows["CUDA available"] == "False"
    assert rows["Python"].startswith(f"{sys.version_info.major}.{sys.version_info.minor}.")
    assert rows["SPILLWAY_SOME_SETTING"] == "7" and rows["SPILLWAY_WORKER_KEY"] == "(set, hidden)"
    assert "do-not-print-me" not in done.stdout


def test_a_torch_that_fails_to_import_is_reported_and_the_rest_still_printed(tmp_path):
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\necho 'Traceback (most recent call last):' >&2\n"
                      "echo 'OSError: libcudart.so.12: cannot open shared object file' >&2\nexit 1\n")
    python.chmod(0o755)
    info = torch_info(str(python))
    assert info == {"error": "import torch failed: OSError: libcudart.so.12: cannot open shared object file"}
    text = report(info, environ={})
    assert "PyTorch                      : import torch failed: OSError: libcudart.so.12" in text
    assert f"spillway                     : {importlib.metadata.version('spillway')}" in text


def test_the_command_line_imports_no_client_benchmark_or_torch_until_one_runs():
    code = ("import sys\nfrom spillway.gateway.cli.main import add_other_commands, build_parser\n"
            "add_other_commands(build_parser())\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch' or m.startswith('spillway.tools')\n"
            "             or m in ('spillway.gateway.cli.bench_serve_report', 'numpy')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout) == (0, "[]\n"), done.stderr
