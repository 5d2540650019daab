"""A tensor-parallel worker: one executor process per device, rank 0 the worker itself.

    worker process (rank 0: driver + executor on device 0)
      ├── python -m spillway.worker.tp.rank   (rank 1: executor on device 1)
      └── ...                                  (rank N-1)

Rank 0 starts the other ranks as programs of their own (their `RankLaunch`, msgpack on their
stdin, never pickled), and they meet in `init_process_group` (NCCL on CUDA, each rank on
cuda:rank; gloo on the CPU) through a TCP store on the loopback that rank 0 holds. Every step
rank 0 runs, and every read or write of KV blocks for another worker (disaggregated prefill:
worker/tp/kv_shards.py), it first broadcasts to the others (worker/tp/channel.py).

No rank outlives the group: a rank exits when its stdin (held open by rank 0) reaches EOF, or
when a collective fails; rank 0 leaves with status 1 the moment a rank exits before being told
to, so the gateway restarts the whole worker.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import signal
import subprocess
import sys
import threading

import msgspec
import numpy as np
import torch
import torch.distributed as dist

from spillway.protocol.config import WorkerConfig, encode_launch, read_launch
from spillway.protocol.tensor_parallel import layout_problems
from spillway.worker.core.readable_prefix import ReadablePrefix
from spillway.worker.runner.executor import PackedStep
from spillway.worker.tp.channel import RankChannel
from spillway.worker.runner.kv_block_io import KvLayout
from spillway.worker.tp.kv_shards import rank_layout, read_blocks_of_ranks, write_blocks_of_ranks

logger = logging.getLogger("spillway.worker")

RANK_COMMAND = (sys.executable, "-m", "spillway.worker.tp.rank")
STORE_HOST = "127.0.0.1"
# A rank that is still loading when another asks for a collective: the group waits this long.
GROUP_TIMEOUT = datetime.timedelta(minutes=30)


class RankLaunch(msgspec.Struct, frozen=True, kw_only=True):
    """What a rank other than 0 reads on its stdin."""

    config: WorkerConfig
    rank: int
    world_size: int
    store_port: int


def check_tensor_parallel(config: WorkerConfig, hf_config, device: torch.device) -> None:
    """ValueError, before any rank starts, for a size the model or the devices cannot take (the
    gateway checks the model first, with its flag's name)."""
    size = config.tensor_parallel_size
    problems = layout_problems(size, hf_config.to_dict())
    if device.type == "cuda" and device.index not in (None, 0):
        problems.append(f"its ranks run on cuda:0..{size - 1}, and the device asked for is {device}")
    if device.type == "cuda" and torch.cuda.device_count() < size:
        problems.append(f"{size} ranks need {size} GPUs, and {torch.cuda.device_count()} are visible")
    if problems:
        raise ValueError(f"tensor parallel size {size} (--tensor-parallel-size): " + "; ".join(problems))


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank `rank`'s device: cuda:rank on CUDA (CUDA_VISIBLE_DEVICES as given), else the CPU."""
    return torch.device("cuda", rank) if device.type == "cuda" else device


def join_group(store: dist.Store, rank: int, world_size: int, device: torch.device) -> None:
    """Enter the default process group. On the CPU each rank takes its share of the cores:
    N ranks with every core each would spend their time preempting one another."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=rank,
                            world_size=world_size, timeout=GROUP_TIMEOUT)


def share_from_rank_zero(value: int, device: torch.device) -> int:
    """Rank 0's `value` on every rank (a broadcast: every rank calls it at the same point)."""
    tensor = torch.tensor([value], dtype=torch.int64, device=device)
    dist.broadcast(tensor, src=0)
    return int(tensor.item())


def read_rank_launch(fd: int) -> RankLaunch:
    """A rank's launch from its stdin (the same framing as the worker's own)."""
    return read_launch(fd, RankLaunch, "rank 0")


class RankGroup:
    """Rank 0's side of the group: the other ranks' processes, the channel to them, the stop."""

    def __init__(self, config: WorkerConfig, device: torch.device) -> None:
        """Start ranks 1..N-1 and join them in the default process group (rank 0 on `device`'s
        first index)."""
        self.world_size = config.tensor_parallel_size
        self.device = rank_device(device, 0)
        self._stopping = False
        self._broken = False
        store = dist.TCPStore(STORE_HOST, 0, self.world_size, is_master=True, wait_for_workers=False,
                              timeout=GROUP_TIMEOUT)
        self.processes: list[subprocess.Popen] = []
        for rank in range(1, self.world_size):
            process = subprocess.Popen(RANK_COMMAND, stdin=subprocess.PIPE)
            process.stdin.write(encode_launch(RankLaunch(config=config, rank=rank, world_size=self.world_size,
                                                        store_port=store.port)))
            process.stdin.flush()  # and kept open: its EOF tells the rank that rank 0 is gone
            self.processes.append(process)
            threading.Thread(target=self._watch, args=(rank, process), name=f"spillway-rank-{rank}-watch",
                             daemon=True).start()
        join_group(store, 0, self.world_size, self.device)
        self.channel = RankChannel(self.device)
        logger.info("tensor parallel group of %d ranks (%s) up: ranks 1..%d are processes %s", self.world_size,
                    dist.get_backend(), self.world_size - 1, [p.pid for p in self.processes])

    @property
    def shard(self) -> tuple[int, int]:
        return 0, self.world_size

    def send_step(self, step: PackedStep, fed_tokens: torch.Tensor | None) -> None:
        with self._collective():
            self.channel.send_step(step, fed_tokens)

    def send_kv_copies(self, copies) -> None:
        """Copies between the tiers that run between steps, to every rank (each runs its share)."""
        with self._collective():
            self.channel.send_kv_copies(copies)

    def kv_layout(self, pool: torch.Tensor) -> KvLayout:
        """A block of this worker as another worker must match it: every rank's share."""
        return rank_layout(pool, self.world_size)

    def read_kv_blocks(self, pool: torch.Tensor, prefix: ReadablePrefix, tier_pool: torch.Tensor | None) -> np.ndarray:
        """Every rank's KV of `prefix`'s blocks, block by block (worker/tp/kv_shards.py)."""
        with self._collective():
            return read_blocks_of_ranks(self.channel, pool, prefix, tier_pool)

    def write_kv_blocks(self, pool: torch.Tensor, payload: memoryview | bytes, pairs: list[tuple[int, int]]) -> None:
        """Block `index` of `payload` into slot `slot` of every rank's pool, for each `(index,
        slot)` of `pairs` (worker/tp/kv_shards.py)."""
        with self._collective():
            write_blocks_of_ranks(self.channel, pool, payload, pairs)

    @contextlib.contextmanager
    def _collective(self):
        try:
            yield
        except BaseException:
            self._broken = True  # a rank is gone: a stop message would wait for it in vain
            raise

    def _watch(self, rank: int, process: subprocess.Popen) -> None:
        """A rank that exits before it is told to takes the worker down: the gateway then
        restarts the whole group (a collective would fail or, with NCCL, wait for it)."""
        code = process.wait()
        if self._stopping:
            return
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
        logger.error("tensor parallel rank %d %s; the worker exits", rank, how)
        sys.stderr.flush()
        os._exit(1)

    def stop(self) -> None:
        """Tell the ranks to stop (when the group still works), wait for them, briefly, and leave
        the process group (so that this process may start another)."""
        if self._stopping:
            return
        self._stopping = True
        if not self._broken:
            try:
                self.channel.stop()
            except Exception:  # a rank already gone: its stdin's EOF ends the others
                logger.warning("the stop message did not reach every rank")
        for process in self.processes:
            process.stdin.close()
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if dist.is_initialized():
            dist.destroy_process_group()
