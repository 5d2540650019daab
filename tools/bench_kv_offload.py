"""The CPU tier's copies on the GPU: store (GPU -> pinned host) and restore (host -> GPU)
bandwidth through the engine's own copier, against a plain pinned copy of the same bytes in
the same run, and whether the bytes come back equal.

    python tools/bench_kv_offload.py                    # Qwen3-8B blocks (2.25 MiB), 2,048 of them
    python tools/bench_kv_offload.py --model smollm2-135m --blocks 8192

Rows: one contiguous run of slots (one transfer per run), and every other slot (one transfer
per block, the worst case of a fragmented pool). The baseline is `tensor.copy_` of one pinned
buffer of the same size, each direction.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a script: tools.*

from tools.bench_ceilings import machine  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-8b", help="built-in config whose block size is copied")
    parser.add_argument("--blocks", type=int, default=2048, help="blocks copied each way")
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_kv_offload needs a CUDA GPU")
    from spillway.protocol.model_files import load_config, resolve_model
    from spillway.worker.kv_copies import KVCopier, allocate_cpu_pool
    from spillway.worker.model_runner import _kv_dims

    layers, kv_heads, head_dim = _kv_dims(load_config(resolve_model(args.model, "dummy")))
    shape = (layers, 2, args.block_size, kv_heads, head_dim)
    num_slots = 2 * args.blocks  # room for the scattered row
    gpu = torch.randn((num_slots, *shape), dtype=torch.bfloat16, device="cuda")
    cpu = allocate_cpu_pool(num_slots, shape, torch.bfloat16, pinned=True)
    copier = KVCopier(gpu, cpu)
    block_bytes = gpu[0].nbytes
    total = args.blocks * block_bytes
    print(f"{machine()}; {args.model} blocks of {block_bytes / 2**20:.2f} MiB, {args.blocks} each way "
          f"({total / 2**30:.2f} GiB)")

    host = torch.empty(total // 2, dtype=torch.bfloat16, pin_memory=True)
    device = torch.empty_like(host, device="cuda")
    baseline = {}
    for name, dst, src in (("store", host, device), ("restore", device, host)):
        seconds = []
        for _ in range(5):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            seconds.append(start.elapsed_time(end) / 1e3)
        baseline[name] = total / sorted(seconds)[2] / 1e9
    print(f"{'copy':>26} {'store GB/s':>11} {'restore GB/s':>13} {'vs pinned copy':>15}")
    print(f"{'pinned tensor copy_':>26} {baseline['store']:11.1f} {baseline['restore']:13.1f} {'1.000 / 1.000':>15}")

    original = gpu[: 2 * args.blocks].clone()
    for label, scattered in (("contiguous run", False), ("every other slot", True)):
        results = sorted(copier.time_copies(args.blocks, scattered=scattered) for _ in range(5))
        store_s, restore_s = results[2]
        store, restore = total / store_s / 1e9, total / restore_s / 1e9
        print(f"{'copier, ' + label:>26} {store:11.1f} {restore:13.1f} "
              f"{store / baseline['store']:7.3f} / {restore / baseline['restore']:.3f}")
    # Store, wipe, restore: every copied byte comes back.
    slots = tuple((slot, slot) for slot in range(args.blocks))
    copier.run(copier_copies(slots, to_cpu=True))
    torch.cuda.synchronize()
    gpu[: args.blocks].zero_()
    copier.run(copier_copies(slots, to_cpu=False))
    copier.wait_for_loads()
    torch.cuda.synchronize()
    equal = torch.equal(gpu[: args.blocks], original[: args.blocks])
    print(f"bytes after a store and a restore equal the original: {equal}")


def copier_copies(pairs, *, to_cpu: bool):
    from spillway.worker.step_plan import KVCopies

    return KVCopies(gpu_to_cpu=pairs) if to_cpu else KVCopies(cpu_to_gpu=pairs)


if __name__ == "__main__":
    main()
