"""Kernel tests run the same Triton source on the CPU (through the interpreter) and on CUDA.

TRITON_INTERPRET=1 must be set before triton is first imported for triton.language's own
helpers to be interpreted; `spillway.kernels.utils.for_device` copes when it was not.
It is left unset where a GPU is present, so that GPU tests compile for real.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    """Skip this folder's CPU tests where Triton's interpreter cannot run the kernels."""
    here = os.path.dirname(__file__)
    cpu_items = [item for item in items if str(item.path).startswith(here) and "gpu" not in item.keywords]
    if not cpu_items:
        return
    from kernel_testing import interpreter_runs_loops

    if interpreter_runs_loops():
        return
    import pytest

    skip = pytest.mark.skip(reason="this Triton's interpreter cannot run loops (Triton 3.6 with NumPy >= 2.4)")
    for item in cpu_items:
        item.add_marker(skip)
