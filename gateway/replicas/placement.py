"""Where each data-parallel replica's worker runs, decided without importing torch.

    CUDA, dp x tp GPUs or more   replica r sees GPUs r*tp .. r*tp+tp-1 (CUDA_VISIBLE_DEVICES),
                                 each at the full --gpu-memory-utilization; they start together
    CUDA, fewer                  every replica shares GPUs 0 .. tp-1; replica r's utilisation is
                                 (r + 1)/dp of the setting and they start one after another: a
                                 worker sizes its pool as the share less the memory in use, so
                                 each takes 1/dp of the setting once those before it have loaded
    CPU                          each replica takes 1/dp of the cores (OMP_NUM_THREADS)

GPUs are counted from CUDA_VISIBLE_DEVICES when set, else from the driver's /proc entries.
Disaggregated prefill and decode (`place_prefill_decode`) places its N producer and M consumer
workers as N + M replicas, producers first.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import msgspec

from spillway.gateway.link.worker_process import WorkerProcess
from spillway.protocol.config import WorkerConfig
from spillway.protocol.kv_transfer import HOST_CONNECTOR, KvTransferConfig

NVIDIA_GPUS = "/proc/driver/nvidia/gpus"
# Where the workers run, by vLLM's `--distributed-executor-backend` names: "mp", processes of this
# host as placed here ("uni", vLLM's one-process executor, runs the same); "ray", on a Ray
# cluster (ray_replicas.py).
EXECUTOR_BACKENDS = ("mp", "uni", "ray")


@dataclass(frozen=True, slots=True)
class ReplicaLaunch:
    config: WorkerConfig
    env: dict[str, str]  # set in the worker's environment, over the gateway's
    name: str = "replica 0"  # what the log calls it ("replica r", "prefill r", "decode r")


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
                   num_cores: int | None = None, what: str | None = None) -> Placement:
    """`what`: the workers as the description names them (default "N replicas")."""
    config = msgspec.structs.replace(config, kv_events=True)  # the router follows each replica's cache
    tp, dp = config.tensor_parallel_size, data_parallel_size
    what = what or f"{dp} replicas"
    gpus = visible_gpus() if gpus is None else gpus
    on_cpu = config.device == "cpu" or (config.device == "auto" and not gpus)
    if on_cpu:
        threads = max(1, (num_cores or os.cpu_count() or 1) // dp)
        launches = [ReplicaLaunch(config, {"OMP_NUM_THREADS": str(threads)}, f"replica {r}") for r in range(dp)]
        return Placement(launches, False, f"{what} on the CPU, {threads} thread{'s' if threads > 1 else ''} each")
    if len(gpus) >= dp * tp:
        launches = [ReplicaLaunch(config, {"CUDA_VISIBLE_DEVICES": ",".join(gpus[r * tp:(r + 1) * tp])}, f"replica {r}")
                    for r in range(dp)]
        return Placement(launches, False, f"{what} on GPUs " + "; ".join(l.env["CUDA_VISIBLE_DEVICES"]
                                                                         for l in launches))
    shared = ",".join(gpus[:tp]) if gpus else None
    utilization = config.gpu_memory_utilization
    launches = [ReplicaLaunch(msgspec.structs.replace(config, gpu_memory_utilization=utilization * (r + 1) / dp),
                              {"CUDA_VISIBLE_DEVICES": shared} if shared else {}, f"replica {r}")
                for r in range(dp)]
    return Placement(launches, True, f"{what} sharing GPU {shared or 'cuda:0'}, "
                                     f"{utilization / dp:.3g} of its memory each")


def place_prefill_decode(config: WorkerConfig, num_prefill: int, num_decode: int, gpus: list[str] | None = None,
                         num_cores: int | None = None) -> Placement:
    """`num_prefill` producer workers, then `num_decode` consumers, placed as that many replicas
    are. Each worker's `kv_transfer` is `config.kv_transfer` (the connector, the load failure
    policy, where a producer listens; HostConnector when none is given) with its own role; the
    producers report their prefix blocks (KvEvents) for routing by prefix, the consumers nothing."""
    base = config.kv_transfer or KvTransferConfig(kv_connector=HOST_CONNECTOR, kv_role="kv_both")
    placement = place_replicas(config, num_prefill + num_decode, gpus, num_cores,
                               what=f"{num_prefill} prefill and {num_decode} decode workers")
    launches = []
    for index, launch in enumerate(placement.launches):
        producer = index < num_prefill
        kv = msgspec.structs.replace(base, kv_role="kv_producer" if producer else "kv_consumer")
        name = f"prefill {index}" if producer else f"decode {index - num_prefill}"
        launches.append(ReplicaLaunch(msgspec.structs.replace(launch.config, kv_transfer=kv, kv_events=producer),
                                      launch.env, name))
    return Placement(launches, placement.sequential, placement.describe)
