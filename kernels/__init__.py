"""Spillway's Triton kernels, installed as `spillway.kernels`.

A process whose `sys.path` holds the checkout's root (`python -m` run there, a test that puts
the root on the path for `tools/`) would find this folder under the bare name `kernels`, which
is also the name of a Hugging Face package that transformers imports (its hub kernels). Imported
under that name, this module hands the name to the installed package, so transformers gets what
it asked for and this folder is only ever `spillway.kernels`.
"""

from __future__ import annotations

if __name__ == "kernels":
    import importlib.machinery
    import importlib.util
    import os
    import sys

    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _elsewhere = [entry for entry in sys.path if os.path.abspath(entry or os.curdir) != _root]
    _spec = importlib.machinery.PathFinder.find_spec("kernels", _elsewhere)
    if _spec is None:
        raise ImportError("no package named 'kernels' is installed (this folder is spillway.kernels)",
                          name="kernels")
    _module = importlib.util.module_from_spec(_spec)
    sys.modules["kernels"] = _module  # the import statement returns what sys.modules holds after this runs
    _spec.loader.exec_module(_module)
