"""Kernel tests run the same Triton source on the CPU (through the interpreter) and on CUDA.

TRITON_INTERPRET=1 must be set before triton is first imported for triton.language's own
helpers to be interpreted; `spillway.kernels.utils.for_device` copes when it was not.
It is left unset where a GPU is present, so that GPU tests compile for real.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

