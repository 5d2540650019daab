"""The checkout's kernels/ folder under the bare name `kernels`, as a process run in the checkout sees it."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_bare_name_kernels_is_never_this_folder():
    code = ("import sys, kernels, spillway.kernels\n"
            "assert kernels is not spillway.kernels\n"
            f"assert not kernels.__file__.startswith({str(ROOT / 'kernels')!r}), kernels.__file__\n"
            "print(kernels.__name__)")
    try:
        importlib.metadata.distribution("kernels")
        installed = True
    except importlib.metadata.PackageNotFoundError:
        installed = False
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    if installed:
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == "kernels"
    else:
        assert done.returncode == 1
        assert "no package named 'kernels' is installed" in done.stderr


def test_transformers_models_import_in_the_checkout():
    """transformers imports Hugging Face's `kernels` (when installed) with its modeling code."""
    done = subprocess.run([sys.executable, "-c", "import transformers.modeling_utils"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
