"""`from spillway import LLM, SamplingParams`, as vLLM users write `from vllm import ...`; the
names load on first use, so a worker process never loads the gateway."""

from __future__ import annotations

import subprocess
import sys

import pytest


def run(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_the_offline_names_come_from_the_top_package():
    import spillway
    from spillway import LLM, SamplingParams
    from spillway.gateway import LLM as GatewayLLM, SamplingParams as GatewaySamplingParams

    assert (LLM, SamplingParams) == (GatewayLLM, GatewaySamplingParams)
    assert sorted(dir(spillway)) == sorted(spillway.__all__)
    with pytest.raises(AttributeError, match="has no attribute 'Engine'"):
        spillway.Engine  # noqa: B018


def test_the_top_package_loads_neither_the_gateway_nor_torch_until_asked():
    out = run("import sys, spillway, spillway.protocol.messages\n"
              "print(sorted({m.split('.')[1] for m in sys.modules if m.startswith('spillway.')}), 'torch' in sys.modules)")
    assert out == "['protocol'] False"


def test_a_worker_import_loads_no_gateway():
    out = run("import sys, spillway.worker.main\n"
              "print(any(m.startswith('spillway.gateway') for m in sys.modules))")
    assert out == "False"


def test_every_source_folder_is_an_installed_package():
    """A non-editable install (a wheel, `pip install .`) holds the packages pyproject.toml lists,
    nothing else: a folder left out is missing there while every editable checkout imports it."""
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    setuptools = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {name: root / path for name, path in setuptools["package-dir"].items()}
    mapped = {path.resolve() for path in folders.values()}
    expected = set()
    for name, folder in folders.items():
        for init in folder.rglob("__init__.py"):
            relative = init.parent.relative_to(folder).parts
            # A folder mapped to a name of its own (gateway/public is `spillway`) is counted under that name.
            if relative and init.parent.resolve() in mapped:
                continue
            if not any(part.startswith(".") or part == "__pycache__" for part in relative):
                expected.add(".".join((name, *relative)))
    assert sorted(expected - set(setuptools["packages"])) == []
