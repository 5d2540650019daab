"""Compiling recorded kernel launches for sm_90 (Hopper) on any machine, with the bundled ptxas:
what tests/kernels/moe_sm90.py and tests/kernels/mla_sm90.py share. Imported in a process of
its own, before anything imports triton with TRITON_INTERPRET set.

The launchers run on CPU tensors with each kernel launch recorded instead of run (`Recorder`
stands in for `for_device`); each recorded launch is specialised as Triton's JIT does
(integers equal to 1 as constants, 16-divisible sizes and pointers marked) and compiled.
"""

from __future__ import annotations

import collections
import os
import re

os.environ.pop("TRITON_INTERPRET", None)  # before triton is imported: compile, do not interpret

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

WATCHED = ("wgmma", "mma.sync", "cp.async.cg", "ld.global.v4")


class Recorder:
    """Stands in for `for_device`: keeps each launch's kernel, grid and arguments."""

    launches: list = []

    def __init__(self, kernel, device) -> None:
        self.kernel = kernel

    def __getitem__(self, grid):
        return lambda *args, **kwargs: Recorder.launches.append((self.kernel, grid, args, kwargs))


POINTEE = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32",
           torch.int64: "i64", torch.float8_e4m3fn: "fp8e4nv"}


def specialised(value) -> tuple[str, bool]:
    """(signature type, 16-divisible) of an argument as Triton's JIT sees it; integers equal to 1
    and None become constants, floats are fp32."""
    if isinstance(value, torch.Tensor):
        return "*" + POINTEE[value.dtype], value.data_ptr() % 16 == 0
    if isinstance(value, float):
        return "fp32", False
    if value is None:  # an optional pointer left out: a constant, as the JIT specialises it
        return "constexpr", False
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"unexpected kernel argument {value!r}")
    if value == 1:
        return "constexpr", False
    return ("i32" if -(2**31) <= value < 2**31 else "i64"), value % 16 == 0


def compile_launch(kernel, args, kwargs):
    options = dict(num_warps=kwargs.pop("num_warps", 4), num_stages=kwargs.pop("num_stages", 3))
    values = {**dict(zip(kernel.arg_names, args)), **kwargs, "PDL": True}
    signature, constants, attrs = {}, {}, {}
    for index, (name, param) in enumerate(zip(kernel.arg_names, kernel.params)):
        kind, divisible = ("constexpr", False) if param.is_constexpr else specialised(values[name])
        signature[name] = kind
        if kind == "constexpr":
            constants[name] = values[name]
        elif divisible:
            attrs[(index,)] = [["tt.divisibility", 16]]
    source = ASTSource(kernel, signature, constexprs=constants, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def launch_report(kernel, grid, args, kwargs) -> dict:
    """A recorded launch compiled: its kernel's name, grid, shared memory and watched PTX ops."""
    compiled = compile_launch(kernel, args, dict(kwargs))
    ops = collections.Counter(re.findall(r"^\s*(?:@!?%p\d+\s+)?([a-z][\w.]*)", compiled.asm["ptx"], re.MULTILINE))
    counts = {name: sum(n for op, n in ops.items() if op.startswith(name)) for name in WATCHED}
    return dict(kernel=kernel.__name__, grid=list(grid), shared=compiled.metadata.shared, ops=counts)
