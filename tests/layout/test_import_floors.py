"""The floors of the code: a lower folder never imports a higher one, and no module imports
itself back through others. Each import is read from the source (at module level, inside a
function or under `TYPE_CHECKING` alike), so a cycle cannot hide behind a deferred import.

The floors, bottom up, are the order of the lists below; each folder's `__init__.py` says what
it owns and what it may import.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOP_FOLDERS = {"protocol": "protocol", "gateway": "gateway", "worker": "worker", "kernels": "kernels"}

# Bottom up. A module sits on the floor of the longest prefix listed; the package's own
# top-level modules (the process files) sit above every folder.
WORKER_FLOORS = ["core", "kv_tier", "sample", "attention", "models", "runner", "tp", "speculative", "driver",
                 "kv_transfer"]
GATEWAY_FLOORS = ["api", "text", "metrics", "link", "replicas", "generation", "offline", "http", "cli"]

# Imports across packages that a package may make (besides its own modules).
MAY_IMPORT = {
    "protocol": set(),
    "kernels": set(),
    "worker": {"protocol", "kernels"},
    "gateway": {"protocol"},
}
# `spillway worker` runs the worker in the command's own process, where torch is wanted.
CROSSINGS_ALLOWED = {("gateway.cli.main", "worker")}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def all_modules() -> dict[str, Path]:
    found = {}
    for top in TOP_FOLDERS:
        for path in sorted((ROOT / top).rglob("*.py")):
            if "public" in path.relative_to(ROOT).parts:
                continue
            found[module_name(path)] = path
    return found


def imports_of(path: Path, modules: dict[str, Path]) -> set[str]:
    """The project's modules that `path` imports (by their names without `spillway.`)."""
    tree = ast.parse(path.read_text(), str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            candidates = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in candidates:
            if not name.startswith("spillway."):
                continue
            name = name.removeprefix("spillway.")
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name:
                names.add(name)
    return names


def floor_of(module: str) -> tuple[str, int]:
    """The package of `module` and its floor there; protocol's wire (protocol/*.py) is the
    floor below protocol/local/."""
    package, _, rest = module.partition(".")
    if package == "protocol":
        return package, int(rest.partition(".")[0] == "local")
    floors = {"worker": WORKER_FLOORS, "gateway": GATEWAY_FLOORS}.get(package)
    if floors is None:
        return package, 0
    folder = rest.partition(".")[0]
    if folder in floors and "." in rest or rest == folder and folder in floors:
        return package, floors.index(folder)
    return package, len(floors)  # the package's own process files: the top floor


def graph() -> dict[str, set[str]]:
    modules = all_modules()
    return {name: imports_of(path, modules) - {name} for name, path in modules.items()}


def test_every_folder_says_what_it_owns_and_may_import():
    for top in ["worker", "gateway"]:
        for init in sorted((ROOT / top).rglob("__init__.py")):
            if init.parent == ROOT / top or "public" in init.parts:
                continue
            doc = ast.get_docstring(ast.parse(init.read_text())) or ""
            assert "May import" in doc, f"{init.relative_to(ROOT)} does not say what it may import"


def test_no_package_imports_one_it_may_not():
    wrong = []
    for module, imported in graph().items():
        package = module.partition(".")[0]
        for name in imported:
            other = name.partition(".")[0]
            if other != package and other not in MAY_IMPORT[package] and (module, other) not in CROSSINGS_ALLOWED:
                wrong.append(f"{module} -> {name}")
    assert wrong == []


def test_no_lower_floor_imports_a_higher_one():
    wrong = []
    for module, imported in graph().items():
        package, floor = floor_of(module)
        for name in imported:
            other_package, other_floor = floor_of(name)
            if other_package == package and other_floor > floor:
                wrong.append(f"{module} -> {name}")
    assert wrong == []


def test_no_import_cycles():
    edges = graph()
    cycles = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        stack.append(module)
        for name in sorted(edges.get(module, ())):
            if name.startswith(module + "."):
                continue  # a package's __init__ importing its own modules
            if state.get(name) == 1 and not module.startswith(name + "."):
                cycles.append(" -> ".join(stack[stack.index(name):] + [name]))
            elif name not in state:
                visit(name)
        stack.pop()
        state[module] = 2

    for module in sorted(edges):
        if module not in state:
            visit(module)
    assert cycles == []


@pytest.mark.parametrize("package", ["protocol"])
def test_the_wire_imports_no_torch_zmq_or_transformers(package):
    heavy = {"torch", "zmq", "transformers", "huggingface_hub", "numpy"}
    wrong = []
    for path in sorted((ROOT / package).glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
            wrong += [f"{path.name}: {n}" for n in names if n.partition(".")[0] in heavy]
    assert wrong == []
