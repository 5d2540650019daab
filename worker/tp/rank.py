"""`python -m spillway.worker.tp.rank`: one tensor-parallel rank other than 0 (worker/tp/group.py).

It reads its `RankLaunch` on stdin, joins the group, starts its executor exactly as rank 0 does
(worker/runner/executor_start.py: its shard of the model, its own heads' KV pool of the group's
block count, the same graphs, a CPU tier of rank 0's block count holding its heads), then runs
every step rank 0 broadcasts until told to stop, each after every copy between its tiers queued
before it (rank 0 plans by its own copies' landings, which this rank's may trail), and its share
of every read or write of KV blocks for another worker (worker/tp/kv_shards.py).
It samples nothing and talks to no gateway. Its stdin's EOF (rank 0 gone, however it ended)
ends it at once, even mid-load; so does a collective that fails (status 1).
"""

from __future__ import annotations

import logging
import os
import sys
import threading

import torch
import torch.distributed as dist

from spillway.kernels.utils import use_programmatic_launch
from spillway.worker.runner.device_settings import resolve_device_settings
from spillway.worker.runner.executor_start import build_executor, finish_start, pool_blocks
from spillway.worker.models import loader
from spillway.worker.tp.channel import KvCopy, KvRead, KvWrite, RankChannel
from spillway.worker.tp.group import (GROUP_TIMEOUT, STORE_HOST, RankLaunch, join_group, rank_device, read_rank_launch,
                                      share_from_rank_zero)
from spillway.worker.tp.kv_shards import send_own_share, write_own_share

logger = logging.getLogger("spillway.worker")


def exit_when_rank_zero_closes(fd: int) -> None:
    """At EOF on `fd` (rank 0 exited), end this process from a daemon thread, whatever it is doing."""

    def watch() -> None:
        while os.read(fd, 1 << 12):
            pass
        os._exit(0)

    threading.Thread(target=watch, name="spillway-rank-zero-watch", daemon=True).start()


def run_rank(launch: RankLaunch) -> None:
    config = launch.config
    device, dtype, kv_cache_dtype = resolve_device_settings(config)
    device = rank_device(device, launch.rank)
    torch.manual_seed(config.seed)
    use_programmatic_launch(config.programmatic_launch)
    store = dist.TCPStore(STORE_HOST, launch.store_port, launch.world_size, is_master=False, timeout=GROUP_TIMEOUT)
    join_group(store, launch.rank, launch.world_size, device)
    files = loader.resolve_model(config.model, config.load_format)
    hf_config = loader.load_config(files)
    executor, limits = build_executor(config, files, hf_config, device=device, dtype=dtype,
                                      kv_cache_dtype=kv_cache_dtype, shard=(launch.rank, launch.world_size))
    executor.allocate_kv_cache(pool_blocks(executor, config, limits, tensor_parallel=True))
    finish_start(executor, config)
    num_cpu_blocks = share_from_rank_zero(0, device)  # rank 0's tier size
    if num_cpu_blocks:
        # Never paced here: this rank queues a step's pending loads before the next step (follow_copies).
        executor.allocate_cpu_kv_cache(num_cpu_blocks, load_bytes_per_s=0.0, load_burst_s=0.0, load_speed_guess=1e9,
                                       size_setting=config.setting("cpu_offload_gb"))
    channel = RankChannel(device)
    pool = executor.runner.kv_cache
    with torch.inference_mode():
        while True:
            message, tensor = channel.receive()
            if message is None:
                return
            if isinstance(message, KvRead):
                if message.prefix.cpu_reads:
                    executor.wait_for_stores()
                send_own_share(pool, message.prefix, executor.tier_pool)
            elif isinstance(message, KvWrite):
                write_own_share(pool, tensor, launch.rank, launch.world_size, message.slots)
            elif isinstance(message, KvCopy):
                executor.follow_copies(message.copies)
            else:
                executor.follow_copies()
                executor.execute(message, tensor)


def main() -> int:
    launch = read_rank_launch(sys.stdin.fileno())
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s %(name)s[rank {launch.rank}] %(levelname)s %(message)s")
    exit_when_rank_zero_closes(sys.stdin.fileno())
    try:
        run_rank(launch)
    except Exception:
        logger.exception("tensor parallel rank %d failed", launch.rank)
        return 1
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # as the worker does: no interpreter teardown (worker/__main__.py says why)
