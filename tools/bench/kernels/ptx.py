"""Compile the decode attention kernel for a GPU target on any machine and count its loops' PTX.

    python tools/bench/kernels/ptx.py --cache-dtype fp8 --block-n 128 --warps 2 --stages 3
    python tools/bench/kernels/ptx.py --cache-dtype bf16 --save /tmp/decode   # also writes .ttgir/.ptx
    git show 0e9885e:kernels/paged_attention_decode.py > /tmp/old.py
    python tools/bench/kernels/ptx.py --kernel-file /tmp/old.py --block-n 64    # an earlier version

No GPU is needed: Triton compiles for the target (default sm_90) with its bundled ptxas (not
under TRITON_INTERPRET=1, which the tool therefore turns off for itself). Each
loop (a backward branch in the PTX) is printed with its instruction count and the instructions
that say most about a paged-attention tile: asynchronous copies (cg: 16 bytes, ca: 4 or 8), one-byte
shared loads, matrix instructions, ldmatrix and e4m3 conversions. Arguments are specialised as
the JIT does for 16-divisible sizes, at the Qwen3-8B heads (32 query, 8 KV heads of 128).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # before triton is imported: compile, do not interpret

WATCHED = ("cp.async.cg", "cp.async.ca", "ld.shared.b8", "mma.sync", "ldmatrix", "cvt.rn.f16x2.e4m3x2")


def compile_decode(cache_dtype: str, block_n: int, warps: int, stages: int, capability: int,
                   one_loop: bool, kernel_file: str | None = None):
    import importlib.util

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if kernel_file:  # another version of paged_attention_decode.py, e.g. from `git show REV:...`
        spec = importlib.util.spec_from_file_location("decode_under_test", kernel_file)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        from spillway.kernels import paged_attention_decode as module
    decode_kernel = reading_kernel(module)

    cache = "*fp8e4nv" if cache_dtype == "fp8" else "*bf16"
    pointers = dict(q_ptr="*bf16", cache_ptr=cache, block_tables_ptr="*i32", context_lens_ptr="*i32",
                    out_ptr="*bf16", part_max_ptr="*fp32", part_sum_ptr="*fp32", part_acc_ptr="*fp32")
    ints = ["stride_q_b", "stride_q_q", "stride_q_h", "stride_c_block", "stride_c_kv", "stride_c_token",
            "stride_c_head", "stride_bt", "layer_offset"]
    signature = {**pointers, **{name: "i64" if name in ("stride_c_block", "layer_offset") else "i32" for name in ints},
                 "qk_scale": "fp32"}
    constants = dict(NUM_HEADS=32, QUERY_LEN=1, GROUP=4, BLOCK_M=16, HEAD_DIM=128, BLOCK_SIZE=16, BLOCK_N=block_n,
                     PIECE=min(16, block_n), NUM_SPLITS=1, DOT_PRECISION="tf32", ONE_LOOP=one_loop,
                     MASKED_STAGES=stages if one_loop else 1, PDL=capability >= 90)
    for name in ("PIECE", "ONE_LOOP", "MASKED_STAGES"):  # not in earlier trees
        if name not in decode_kernel.arg_names:
            del constants[name]
    signature.update({name: "constexpr" for name in constants})
    names = list(signature)
    divisible = {(names.index(name),): [["tt.divisibility", 16]] for name in (*pointers, *ints)}
    source = ASTSource(decode_kernel, signature, constexprs=constants, attrs=divisible)
    return triton.compile(source, target=GPUTarget("cuda", capability, 32),
                          options=dict(num_warps=warps, num_stages=stages))


def reading_kernel(module):
    """The module's Triton kernel that reads the queries and the cache (`q_ptr`, `cache_ptr`):
    the decode kernel in every version of the file (the split reduction reads neither)."""
    from triton.runtime.jit import JITFunction

    kernels = [value for value in vars(module).values()
               if isinstance(value, JITFunction) and {"q_ptr", "cache_ptr"} <= set(value.arg_names)]
    assert len(kernels) == 1, f"{module.__name__} has {len(kernels)} kernels that read q and the cache"
    return kernels[0]


def loop_histograms(ptx: str) -> list[tuple[int, collections.Counter]]:
    """(instructions, opcode counts) of every loop: from a label to the branch back to it."""
    lines = ptx.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"^(\$L__BB\d+_\d+):", line))}
    loops = []
    for i, line in enumerate(lines):
        m = re.search(r"bra(?:\.uni)?\s+(\$L__BB\d+_\d+);", line)
        if m and labels.get(m.group(1), i) < i:
            body = (x.strip() for x in lines[labels[m.group(1)]: i + 1])
            ops = [re.sub(r"^@!?%p\d+\s+", "", x).split()[0] for x in body
                   if x and not x.startswith(("//", ".loc", "$L", "{", "}"))]
            loops.append((len(ops), collections.Counter(ops)))
    return loops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache-dtype", choices=["bf16", "fp8"], default="fp8")
    parser.add_argument("--block-n", type=int, default=None, help="keys per tile (default: the launcher's)")
    parser.add_argument("--warps", type=int, default=None)
    parser.add_argument("--stages", type=int, default=None)
    parser.add_argument("--one-loop", action="store_true", help="every tile in one masked loop (ONE_LOOP)")
    parser.add_argument("--capability", type=int, default=90, help="compute capability, e.g. 90 for sm_90")
    parser.add_argument("--save", help="write PREFIX.ttgir and PREFIX.ptx")
    parser.add_argument("--kernel-file", help="compile this paged_attention_decode.py instead of the installed one")
    parser.add_argument("--json", action="store_true", help="print the counts as one JSON object")
    args = parser.parse_args()
    fp8 = args.cache_dtype == "fp8"
    block_n = args.block_n or (128 if fp8 else 64)
    warps, stages = args.warps or (2 if fp8 else 4), args.stages or (3 if fp8 else 2)
    kernel = compile_decode(args.cache_dtype, block_n, warps, stages, args.capability, args.one_loop,
                            args.kernel_file)
    if args.save:
        Path(f"{args.save}.ttgir").write_text(kernel.asm["ttgir"])
        Path(f"{args.save}.ptx").write_text(kernel.asm["ptx"])
    loops = loop_histograms(kernel.asm["ptx"])
    if args.json:
        print(json.dumps({"shared": kernel.metadata.shared,
                          "loops": [{"instructions": count, "ops": dict(ops)} for count, ops in loops]}))
        return
    print(f"decode kernel, {args.cache_dtype} cache, BLOCK_N {block_n}, {warps} warps, {stages} stages, "
          f"{'one loop' if args.one_loop else 'two loops'}, sm_{args.capability}: "
          f"{kernel.metadata.shared} bytes of shared memory")
    for count, ops in loops:
        watched = {name: sum(n for op, n in ops.items() if op.startswith(name)) for name in WATCHED}
        print(f"  loop: {count} instructions; " + ", ".join(f"{name} {n}" for name, n in watched.items() if n))


if __name__ == "__main__":
    main()
