"""Every script under tools/ runs: `python tools/<path>.py --help` exits 0 with its usage, on a
machine without a GPU. A script is a file with a `__main__` block (or a package's __main__.py,
run as `python tools/<package>`); the helpers beside the scripts have none."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ROOT / "tools"


def scripts() -> list[str]:
    """Paths relative to the root, as a user types them."""
    found = []
    for path in sorted(TOOLS.rglob("*.py")):
        if path.name == "__main__.py":
            found.append(str(path.parent.relative_to(ROOT)))
        elif 'if __name__ == "__main__":' in path.read_text():
            found.append(str(path.relative_to(ROOT)))
    return found


SCRIPTS = scripts()


@cache
def help_runs() -> dict[str, subprocess.CompletedProcess]:
    """Every script's --help, run at once: each is a separate interpreter, most of its time
    spent importing."""
    def run(script: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, script, "--help"], cwd=ROOT, capture_output=True, text=True,
                              timeout=300, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})

    with ThreadPoolExecutor(max_workers=8) as pool:
        return dict(zip(SCRIPTS, pool.map(run, SCRIPTS)))


def test_the_scripts_are_found():
    assert {"tools/bench/engine/engine.py", "tools/bench/serve/serve.py", "tools/bench/tier/served.py",
            "tools/bench/kernels/attention.py", "tools/bench/kernels/moe.py", "tools/bench/kernels/tune_moe.py",
            "tools/soak/served.py", "tools/loadgen"} <= set(SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_exits_0_with_its_usage(script):
    done = help_runs()[script]
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("usage: "), done.stdout[:500]


def test_no_helper_is_named_like_a_benchmark():
    helpers = [path for path in TOOLS.rglob("*.py") if str(path.relative_to(ROOT)) not in SCRIPTS
               and path.parent.relative_to(ROOT).as_posix() not in SCRIPTS]
    assert helpers, "the helpers beside the scripts"
    assert [str(path) for path in helpers if path.name.startswith("bench_")] == []
