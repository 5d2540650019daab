"""Where each data-parallel replica's worker runs, decided without importing torch.

    CUDA, dp x tp GPUs or more   replica r sees GPUs r*tp .. r*tp+tp-1 (CUDA_VISIBLE_DEVICES),
                                 each at the full --gpu-memory-utilization; they start together
    CUDA, fewer                  every replica shares GPUs 0 .. tp-1; replica r's utilisation is
                                 (r + 1)/dp of the setting and they start one after another: a
                                 worker sizes its pool as the share less the memory in use, so
                                 each takes 1/dp of the setting once those before it have loaded
    CPU                          each replica takes 1/dp of the cores (OMP_NUM_THREADS)

GPUs are counted from CUDA_VISIBLE_DEVICES when set, else from the driver's /proc entries.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import msgspec

from spillway.gateway.link.worker_process import WorkerProcess
from spillway.protocol.config import WorkerConfig

NVIDIA_GPUS = "/proc/driver/nvidia/gpus"
# Where the workers run, by vLLM's `--distributed-executor-backend` names: "mp", processes of this
# host as placed here ("uni", vLLM's one-process executor, runs the same); "ray", on a Ray
# cluster (ray_replicas.py).
EXECUTOR_BACKENDS = ("mp", "uni", "ray")


@dataclass(frozen=True, slots=True)
class ReplicaLaunch:
    config: WorkerConfig
    env: dict[str, str]  # set in the worker's environment, over the gateway's


@dataclass(frozen=True, slots=True)
class Placement:
    launches: list[ReplicaLaunch]
    sequential: bool  # start one after another (they share a GPU's memory)
    describe: str

    def start_workers(self) -> list:
        """Each replica's `start_worker`: a local worker process where this placement puts it."""
        return [functools.partial(WorkerProcess, launch.config, env=launch.env) for launch in self.launches]


def visible_gpus(environ=os.environ, driver_dir: str = NVIDIA_GPUS) -> list[str]:
    """The GPU ids a worker started from here would see, as CUDA_VISIBLE_DEVICES names them."""
    listed = environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [name.strip() for name in listed.split(",") if name.strip() and name.strip() != "-1"]
    try:
        return [str(k) for k in range(len(os.listdir(driver_dir)))]
    except OSError:
        return []


def place_replicas(config: WorkerConfig, data_parallel_size: int, gpus: list[str] | None = None,
                   num_cores: int | None = None) -> Placement:
    config = msgspec.structs.replace(config, kv_events=True)  # the router follows each replica's cache
    tp, dp = config.tensor_parallel_size, data_parallel_size
    gpus = visible_gpus() if gpus is None else gpus
    on_cpu = config.device == "cpu" or (config.device == "auto" and not gpus)
    if on_cpu:
        threads = max(1, (num_cores or os.cpu_count() or 1) // dp)
        launches = [ReplicaLaunch(config, {"OMP_NUM_THREADS": str(threads)}) for _ in range(dp)]
        return Placement(launches, False, f"{dp} replicas on the CPU, {threads} thread{'s' if threads > 1 else ''} each")
    if len(gpus) >= dp * tp:
        launches = [ReplicaLaunch(config, {"CUDA_VISIBLE_DEVICES": ",".join(gpus[r * tp:(r + 1) * tp])})
                    for r in range(dp)]
        return Placement(launches, False, f"{dp} replicas on GPUs " + "; ".join(l.env["CUDA_VISIBLE_DEVICES"]
                                                                              for l in launches))
    shared = ",".join(gpus[:tp]) if gpus else None
    utilization = config.gpu_memory_utilization
    launches = [ReplicaLaunch(msgspec.structs.replace(config, gpu_memory_utilization=utilization * (r + 1) / dp),
                              {"CUDA_VISIBLE_DEVICES": shared} if shared else {})
                for r in range(dp)]
    return Placement(launches, True, f"{dp} replicas sharing GPU {shared or 'cuda:0'}, "
                                     f"{utilization / dp:.3g} of its memory each")
