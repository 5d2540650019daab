"""Compile every launch of one fused_experts call for sm_90, on any machine; print a JSON line a launch.

    python tests/kernels/moe_sm90.py T K E H I [CONFIG_JSON]

The launchers run on CPU tensors with each kernel launch recorded instead of run (a call never
reads its results on the host, so nothing else is needed); each recorded launch is specialised
as Triton's JIT does (integers equal to 1 as constants, 16-divisible sizes and pointers marked)
and compiled with the bundled ptxas. Run in its own process without TRITON_INTERPRET.
"""

from __future__ import annotations

import collections
import json
import os
import re
import sys

os.environ.pop("TRITON_INTERPRET", None)  # before triton is imported: compile, do not interpret

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from spillway.kernels import moe_align, moe_grouped, moe_pairs  # noqa: E402
from spillway.kernels.fused_moe import fused_experts  # noqa: E402
from spillway.kernels.moe_config import MoeConfig  # noqa: E402

WATCHED = ("wgmma", "mma.sync", "cp.async.cg", "ld.global.v4")


class Recorder:
    """Stands in for `for_device`: keeps each launch's kernel, grid and arguments."""

    launches: list = []

    def __init__(self, kernel, device) -> None:
        self.kernel = kernel

    def __getitem__(self, grid):
        return lambda *args, **kwargs: Recorder.launches.append((self.kernel, grid, args, kwargs))


POINTEE = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32",
           torch.int64: "i64"}


def specialised(value) -> tuple[str, bool]:
    """(signature type, 16-divisible) of an argument as Triton's JIT sees it; integers equal to 1
    become constants."""
    if isinstance(value, torch.Tensor):
        return "*" + POINTEE[value.dtype], value.data_ptr() % 16 == 0
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


def main() -> None:
    num_tokens, top_k, num_experts, hidden, intermediate = map(int, sys.argv[1:6])
    config = MoeConfig.from_json(json.loads(sys.argv[6])) if len(sys.argv) > 6 else None
    for module in (moe_align, moe_grouped, moe_pairs):
        module.for_device = Recorder
    dtype = torch.bfloat16
    fused_experts(torch.empty(num_tokens, hidden, dtype=dtype), torch.empty(num_experts, 2 * intermediate, hidden,
                  dtype=dtype), torch.empty(num_experts, hidden, intermediate, dtype=dtype),
                  torch.rand(num_tokens, top_k), torch.randint(0, num_experts, (num_tokens, top_k)), config=config)
    for kernel, grid, args, kwargs in Recorder.launches:
        compiled = compile_launch(kernel, args, dict(kwargs))
        ops = collections.Counter(re.findall(r"^\s*(?:@!?%p\d+\s+)?([a-z][\w.]*)", compiled.asm["ptx"], re.MULTILINE))
        counts = {name: sum(n for op, n in ops.items() if op.startswith(name)) for name in WATCHED}
        print(json.dumps(dict(kernel=kernel.__name__, grid=list(grid), shared=compiled.metadata.shared, ops=counts)))


if __name__ == "__main__":
    main()
