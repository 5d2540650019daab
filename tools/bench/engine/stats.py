"""What a routine Stats report costs the worker, against the invariant check it used to run.

    python tools/bench/engine/stats.py [--num-blocks 100000] [--num-requests 200]

Builds the driver's state without a model (block manager, scheduler, requests that hold and
cache blocks), then times `collect_stats` as `Engine.stats()` calls it on a routine report
(no invariant check) against `BlockManager.check_invariants()` measured in the same run.
A routine report must stay under 1 ms; the ratio says how much the check costs beside it.
"""

from __future__ import annotations

import argparse
import platform
import time
from datetime import date


from spillway.protocol.hashing import DEFAULT_HASH_SEED, block_hashes, root_hash  # noqa: E402
from spillway.protocol.messages import Generate, SamplingParams  # noqa: E402
from spillway.worker.core.block_manager import BlockManager  # noqa: E402
from spillway.worker.core.request import Request  # noqa: E402
from spillway.worker.core.scheduler import Scheduler  # noqa: E402

BLOCK_SIZE = 16
MAX_MODEL_LEN = 8192


def build_state(num_blocks: int, num_requests: int) -> tuple[BlockManager, Scheduler]:
    """A pool with requests running (blocks referenced) and finished ones (blocks cached)."""
    manager = BlockManager(num_blocks, BLOCK_SIZE, enable_prefix_caching=True)
    root = root_hash(DEFAULT_HASH_SEED, "bench-stats")
    scheduler = Scheduler(manager, max_num_seqs=num_requests, max_num_batched_tokens=1 << 30,
                          max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE, root_hash=root,
                          eos_token_ids=[0])
    # Each request covers an equal share of half the pool, so half its blocks end up referenced.
    prompt_len = min(MAX_MODEL_LEN - 1, num_blocks * BLOCK_SIZE // (2 * num_requests))
    for index in range(num_requests):
        prompt = [1 + (index * 7919 + position) % 30000 for position in range(prompt_len)]
        msg = Generate(request_id=f"r{index}", prompt_token_ids=prompt,
                       block_hashes=block_hashes(prompt, BLOCK_SIZE, root),
                       params=SamplingParams(max_tokens=2, ignore_eos=True))
        scheduler.add(Request.from_generate(msg, index))
    plan = scheduler.schedule()
    # Every prompt is computed; half the requests finish (their blocks go to the cache).
    scheduler.update(plan, {chunk.request.request_id: 5 for chunk in plan.chunks})
    scheduler.abort([f"r{index}" for index in range(0, num_requests, 2)])
    return manager, scheduler


def best_seconds(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-blocks", type=int, default=100_000)
    parser.add_argument("--num-requests", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    from spillway.worker.driver.stats import collect_stats  # the driver's floor imports torch: not for --help

    manager, scheduler = build_state(args.num_blocks, args.num_requests)
    print(f"{platform.node()} ({platform.processor() or platform.machine()}), {date.today()}, python "
          f"{platform.python_version()}: {manager.num_gpu_blocks} blocks, {manager.num_free_blocks} free, "
          f"{manager.num_cached_blocks} cached, {scheduler.num_running} requests running")
    routine = best_seconds(lambda: collect_stats(manager, scheduler, num_steps=0, check_invariants=False),
                           args.repeat * 50)
    check = best_seconds(manager.check_invariants, args.repeat)
    checked = best_seconds(lambda: collect_stats(manager, scheduler, num_steps=0, check_invariants=True),
                           args.repeat)
    print(f"stats() routine report:         {routine * 1e3:9.4f} ms")
    print(f"check_invariants() alone:       {check * 1e3:9.4f} ms")
    print(f"stats() with the check (asked): {checked * 1e3:9.4f} ms")
    print(f"ratio check / routine report:   {check / routine:9.0f}x")
    if routine >= 1e-3:
        raise SystemExit(f"a routine stats() report took {routine * 1e3:.3f} ms, over its 1 ms limit")


if __name__ == "__main__":
    main()
