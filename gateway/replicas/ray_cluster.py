"""The Ray cluster the replicas run on (`--distributed-executor-backend ray`): joining it, and
what one replica reserves there.

    this process in one already, RAY_ADDRESS, or this host's `ray start`   join that cluster
    none of these                                                          start a local one

    CUDA (device cuda*, or auto with GPUs in the cluster)   one bundle {"GPU": tp} a replica
    CPU  (device cpu, or auto with none)                    one bundle {"CPU": tp} a replica

A replica's bundle is the whole of its placement group: a worker's tensor-parallel ranks are one
process tree on one host, so its GPUs are on one node. Ray is an optional dependency, imported
only here and only when asked for.
"""

from __future__ import annotations

import signal
import threading
from dataclasses import dataclass

from spillway.protocol.config import WorkerConfig

INSTALL_HINT = "pip install ray"


class RayMissing(ImportError):
    """`ray` is not installed; the message says how to install it."""


def import_ray():
    try:
        import ray
    except ImportError:
        raise RayMissing(f"the ray backend needs Ray, which is not installed: {INSTALL_HINT}") from None
    return ray


def ray_installed() -> bool:
    try:
        import_ray()
    except RayMissing:
        return False
    return True


def join_cluster():
    """The `ray` module, connected: to the cluster this process is in already, else RAY_ADDRESS's,
    else the one this host last joined with `ray start`, else a local one started here and ended
    with this process. Not ray.init(address="auto"), which also joins any other process's
    local instance it finds running on this host (another script's throwaway cluster)."""
    ray = import_ray()
    if ray.is_initialized():
        return ray
    on_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if on_main_thread else None
    try:
        ray.init()
    finally:
        if on_main_thread:
            # ray.init takes SIGTERM for a plain exit; `spillway serve` stops in order on it.
            signal.signal(signal.SIGTERM, previous)
    return ray


@dataclass(frozen=True, slots=True)
class ReplicaBundle:
    resources: dict[str, float]  # the placement group's one bundle
    env: dict[str, str]  # set in the worker's environment (Ray sets CUDA_VISIBLE_DEVICES itself)

    def describe(self, data_parallel_size: int) -> str:
        (name, count), = self.resources.items()
        return (f"{_counted(data_parallel_size, 'replica')} on the Ray cluster, "
                f"{_counted(count, name)} {'each' if data_parallel_size > 1 else 'reserved'}")


def _counted(count: float, noun: str) -> str:
    return f"{count:g} {noun}{'s' if count != 1 else ''}"


def replica_bundle(config: WorkerConfig, cluster_resources: dict[str, float]) -> ReplicaBundle:
    """What one replica reserves on a cluster of `cluster_resources` (ray.cluster_resources())."""
    gpus = cluster_resources.get("GPU", 0)
    ranks = float(config.tensor_parallel_size)
    on_cpu = config.device == "cpu" or (config.device == "auto" and gpus == 0)
    if on_cpu:  # a rank's process a core, one thread each
        return ReplicaBundle({"CPU": ranks}, {"OMP_NUM_THREADS": "1"})
    if ":" in config.device:
        raise RuntimeError(f"{config.spell('device', config.device)}: Ray gives each replica its GPUs; "
                           f"name none ({config.spell('device', 'cuda')})")
    if gpus == 0:
        raise RuntimeError(f"the Ray cluster has no GPUs for {config.spell('device', config.device)}")
    return ReplicaBundle({"GPU": ranks}, {})
