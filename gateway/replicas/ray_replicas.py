"""Data-parallel replicas placed on a Ray cluster (`--distributed-executor-backend ray`).

    gateway node                                  any node of the cluster
    ReplicaSet ── replica r's EngineClient         placement group r: one bundle (ray_cluster.py)
                    └ ActorWorker ── RemoteWorker ◀══ tcp, CURVE ══▶ python -m spillway.worker
                      (tcp://NODE_IP:PORT, PORT+1)                      └ child of actor r (WorkerHost)

Each replica has a placement group of its own (strategy PACK), an actor on its bundle that keeps
the replica's worker running (worker_host.py: restarted when it exits; the actor itself is
restarted by Ray if its process dies), and two ports of its own on the gateway's node IP, the
remote worker link: CURVE keys from a secret made for this gateway's run and handed to the
actors, never written on a command line. The workers get the WorkerConfig a local replica would
(KV events on); each connects to its replica's ports. `close` stops the actors (their workers
exit with them) and removes the placement groups.
"""

from __future__ import annotations

import functools
import logging
import secrets
import socket
import time

import msgspec
import zmq

from spillway.gateway.link.remote_worker import RemoteWorker, worker_addresses
from spillway.gateway.link.worker_link import PROGRESS_INTERVAL_S
from spillway.gateway.link.worker_process import EXIT_WAIT_S
from spillway.gateway.replicas.actor_worker import ACTOR_ANSWER_S, ActorWorker
from spillway.gateway.replicas.ray_cluster import join_cluster, replica_bundle
from spillway.gateway.replicas.worker_host import WorkerHost
from spillway.protocol.config import WorkerConfig
from spillway.protocol.local.link_auth import LinkKeys

logger = logging.getLogger("spillway.gateway")

BIND_ATTEMPTS = 20  # ports taken between finding them free and binding them
# Calls in flight on one actor: a wait for each worker's exit the gateway watches (the current
# one, and old ones that answer at once), the current worker's pid, a kill and the stop.
ACTOR_CONCURRENCY = 8
# The actor closes its worker's pipe and waits EXIT_WAIT_S before killing it; then it answers.
STOP_TIMEOUT_S = EXIT_WAIT_S + ACTOR_ANSWER_S


class RayReplicas:
    """The replicas' placement groups, actors and links; `start_workers[r]` is replica r's
    `start_worker` for ReplicaSet (or EngineClient, with one replica)."""

    def __init__(self, config: WorkerConfig, data_parallel_size: int, ready_timeout_s: float = 600.0) -> None:
        self._ray = ray = join_cluster()
        self.bundle = replica_bundle(config, ray.cluster_resources())
        self._groups: list = []
        self._actors: list = []
        self._links: list[RemoteWorker] = []
        try:
            self._place(msgspec.structs.replace(config, kv_events=True), data_parallel_size, ready_timeout_s)
        except BaseException:
            self.close()
            raise
        self.start_workers = [functools.partial(ActorWorker, link, actor, r)
                              for r, (link, actor) in enumerate(zip(self._links, self._actors))]

    def _place(self, config: WorkerConfig, data_parallel_size: int, ready_timeout_s: float) -> None:
        from ray.util.placement_group import placement_group

        ray = self._ray
        for _ in range(data_parallel_size):  # appended one by one: `close` undoes what was made
            self._groups.append(placement_group([self.bundle.resources], strategy="PACK"))
        self._wait_placed(ready_timeout_s)
        secret = secrets.token_hex(32)  # this run's link key: the actors hand it to their workers
        keys = LinkKeys.from_secret(secret.encode())
        node_ip = ray.util.get_node_ip_address()
        for _ in range(data_parallel_size):
            self._links.append(bind_link(node_ip, config, keys))
        host = ray.remote(WorkerHost)
        encoded = msgspec.msgpack.encode(config)
        for group, link in zip(self._groups, self._links):
            self._actors.append(host.options(**self._actor_options(group)).remote(
                encoded, *worker_addresses(link.address), secret, self.bundle.env))
        logger.info("%s; the gateway's links on %s", self.bundle.describe(data_parallel_size), node_ip)

    def _actor_options(self, group) -> dict:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        resources = self.bundle.resources
        return dict(num_cpus=resources.get("CPU", 0), num_gpus=resources.get("GPU", 0), max_restarts=-1,
                    max_concurrency=ACTOR_CONCURRENCY,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0))

    def _wait_placed(self, timeout_s: float) -> None:
        started = time.monotonic()
        waiting = [group.ready() for group in self._groups]
        while waiting:
            _, waiting = self._ray.wait(waiting, num_returns=len(waiting), timeout=PROGRESS_INTERVAL_S)
            waited = time.monotonic() - started
            if waiting and waited >= timeout_s:
                raise RuntimeError(f"the Ray cluster did not reserve {self.bundle.resources} for "
                                   f"{len(waiting)} of the replicas within {timeout_s:.0f} s "
                                   f"(available now: {self._ray.available_resources()})")
            if waiting:
                logger.info("waiting for the Ray cluster to reserve %s for %d replicas (%.0f s)",
                            self.bundle.resources, len(waiting), waited)

    def close(self) -> None:
        """Stop the workers and their actors, remove the placement groups, unbind the links."""
        from ray.util.placement_group import remove_placement_group

        ray = self._ray
        # At interpreter exit Ray may have disconnected first: then the cluster has ended this
        # job's actors and placement groups itself.
        if ray.is_initialized():
            stops = [actor.stop.remote() for actor in self._actors]
            if stops:
                ray.wait(stops, num_returns=len(stops), timeout=STOP_TIMEOUT_S)
            for actor in self._actors:
                ray.kill(actor)  # its worker, should one remain, exits at its launch pipe's EOF
            for group in self._groups:
                remove_placement_group(group)
        for link in self._links:
            link.shutdown()
        self._actors, self._groups, self._links = [], [], []


def bind_link(host: str, config: WorkerConfig, keys: LinkKeys) -> RemoteWorker:
    """A remote worker link on two free consecutive ports of `host`."""
    last_error: Exception | None = None
    for _ in range(BIND_ATTEMPTS):
        port = _free_port(host)
        if port >= 65535:
            continue
        address = f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"
        try:
            return RemoteWorker(address, config, keys=keys)
        except zmq.ZMQError as exc:  # the next port was taken
            last_error = exc
    raise RuntimeError(f"no two free consecutive ports on {host} for a replica's link: {last_error}")


def _free_port(host: str) -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]
