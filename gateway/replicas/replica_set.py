"""N engine replicas behind one gateway (`--data-parallel-size N`): the client the routes and
`LLM` use when there is more than one, with EngineClient's interface.

    submit ── Router.choose (cache_index: held + routed blocks; loads) ──▶ replica r's EngineClient
    each replica's StepOutputs.kv_events ──▶ CacheIndex.apply(r, ...)
    a replica lost ──▶ its index forgotten, its streams end with WorkerLost, or go to another
                       replica when nothing of them had come back; its link starts a new worker

A replica is routed to while its link is ready and its worker has been heard within
`ROUTING_SILENCE_S` (`MISSED_BEATS` of its heartbeats, worker/heartbeat.py): one that stops
answering leaves routing at once, long before its heartbeat timeout gives it up.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Sequence

from spillway.gateway.link.client import EngineClient, EngineUnavailable, RequestStream, WorkerLost
from spillway.gateway.replicas.merged_stats import merge_stats
from spillway.gateway.replicas.router import Router
from spillway.protocol.messages import HEARTBEAT_INTERVAL_S, Generate, KvEvents, Ready, Stats

logger = logging.getLogger("spillway.gateway")

# A worker that misses this many beats in a row (HEARTBEAT_INTERVAL_S apart) leaves routing.
MISSED_BEATS = 8
ROUTING_SILENCE_S = MISSED_BEATS * HEARTBEAT_INTERVAL_S


def _engine_metrics(metrics, index: int):
    return None if metrics is None else metrics.engine(index)


class ReplicaSet:
    def __init__(self, start_workers: Sequence[Callable[[], object]], *, routing: str, max_num_seqs: int,
                 metrics=None, sequential_start: bool = False, first_engine: int = 0, name: str = "replica",
                 on_replica_lost: Callable[[int], None] | None = None, **client_options) -> None:
        """`first_engine`: the metrics' engine label of replica 0 (the others follow); `name`:
        what the log calls a replica ("replica", or a role's "prefill" and "decode");
        `on_replica_lost`: called with a replica's index when its worker is lost."""
        self.name = name
        self._on_replica_lost = on_replica_lost
        self.router = Router(routing, len(start_workers), max_num_seqs)
        self._metrics = [_engine_metrics(metrics, first_engine + r) for r in range(len(start_workers))]
        self._sequential_start = sequential_start
        self._routed: dict[str, tuple[int, list[bytes]]] = {}  # sub-request id -> (replica, its blocks)
        self.replicas = [
            EngineClient(start, metrics=self._metrics[r], on_kv_events=functools.partial(self._on_events, r),
                         on_request_done=self._on_request_done, on_worker_lost=functools.partial(self._on_lost, r),
                         log_prefix=f"{name} {r}: ", **client_options)
            for r, start in enumerate(start_workers)]

    # ---- the EngineClient interface ------------------------------------------------------------

    async def start(self) -> Ready:
        if self._sequential_start:
            readies = [await replica.start() for replica in self.replicas]
        else:
            readies = await asyncio.gather(*(replica.start() for replica in self.replicas))
        check_alike(readies, self.name)
        return readies[0]

    async def close(self) -> None:
        await asyncio.gather(*(replica.close() for replica in self.replicas))

    @property
    def ready(self) -> Ready:
        return next((r.ready for r in self.replicas if r.healthy), self.replicas[0].ready)

    @property
    def healthy(self) -> bool:
        return any(replica.healthy for replica in self.replicas)

    @property
    def num_in_flight(self) -> int:
        return sum(replica.num_in_flight for replica in self.replicas)

    @property
    def lost_reason(self) -> str | None:
        return next((r.lost_reason for r in self.replicas if r.lost_reason), None)

    @property
    def last_stats(self) -> Stats | None:
        reports = [replica.last_stats for replica in self.replicas if replica.last_stats is not None]
        return merge_stats(reports) if reports else None

    def submit(self, generates: list[Generate], num_samples: int = 1) -> RoutedStream:
        """Send one HTTP request's sub-requests to one replica, chosen by its first prompt's blocks."""
        stream = RoutedStream(self, generates, num_samples)
        stream.use(*self.send(generates, num_samples))
        return stream

    def replica_states(self) -> list[str]:
        """Each replica's link state, by index: "ready", "starting", "restarting" or "closed"."""
        return [replica.link.state.name.lower() for replica in self.replicas]

    async def refresh_stats(self, timeout_s: float = 1.0) -> Stats | None:
        await asyncio.gather(*(replica.refresh_stats(timeout_s) for replica in self.replicas))
        return self.last_stats

    async def stats(self, timeout_s: float | None = None, check_invariants: bool = False) -> Stats:
        live = [replica for replica in self.replicas if replica.healthy]
        if not live:
            raise EngineUnavailable("the engine is not ready: no replica's worker is running")
        return merge_stats(await asyncio.gather(*(replica.stats(timeout_s, check_invariants) for replica in live)))

    def reset_prefix_cache(self) -> None:
        live = [replica for replica in self.replicas if replica.healthy]
        if not live:
            raise EngineUnavailable("the engine is not ready: no replica's worker is running")
        for replica in live:
            replica.reset_prefix_cache()

    # ---- routing ---------------------------------------------------------------------------

    def send(self, generates: list[Generate], num_samples: int, excluded: frozenset[int] = frozenset(),
             stream=None) -> tuple[int, RequestStream]:
        """Route one request's sub-requests to a replica (not one of `excluded`): (that replica, the
        stream its deltas go to: `stream`, else a new one; see EngineClient.submit)."""
        ready = [r not in excluded and replica.healthy for r, replica in enumerate(self.replicas)]
        if not any(ready):
            raise EngineUnavailable(f"the engine is not ready: no {self.name}'s worker is running")
        eligible = [ok and replica.silent_s < ROUTING_SILENCE_S for ok, replica in zip(ready, self.replicas)]
        if not any(eligible):  # workers that do not beat are silent while idle: all quiet is no sign
            eligible = ready
        loads = [replica.num_in_flight for replica in self.replicas]
        replica, reason = self.router.choose(generates[0].block_hashes, loads, eligible)
        inner = self.replicas[replica].submit(generates, num_samples, stream)
        for generate in generates:
            self._routed[generate.request_id] = (replica, generate.block_hashes)
            self.router.index.route(replica, generate.block_hashes)
        if self._metrics[replica] is not None:
            self._metrics[replica].on_routed(reason.value)
        return replica, inner

    def _on_events(self, replica: int, events: KvEvents) -> None:
        self.router.index.apply(replica, events)

    def _on_request_done(self, request_id: str) -> None:
        routed = self._routed.pop(request_id, None)
        if routed is not None:
            self.router.index.unroute(*routed)

    def _on_lost(self, replica: int) -> None:
        self.router.index.forget(replica)
        if self._on_replica_lost is not None:
            self._on_replica_lost(replica)
        logger.warning("%s %d lost its worker (%s); routing around it while it restarts", self.name, replica,
                       self.replicas[replica].lost_reason)


class RoutedStream:
    """A request's deltas from the replica it went to. If that replica's worker is lost before
    anything of the request came back, it is sent again to another replica (once per replica)."""

    def __init__(self, replicas: ReplicaSet, generates: list[Generate], num_samples: int) -> None:
        self._replicas = replicas
        self._generates = generates
        self._num_samples = num_samples
        self._tried: set[int] = set()
        self._heard = False
        self._inner: RequestStream | None = None
        self.replica = -1

    def use(self, replica: int, inner: RequestStream) -> None:
        self.replica, self._inner = replica, inner
        self._tried.add(replica)

    @property
    def open_ids(self) -> set[str]:
        return self._inner.open_ids

    async def next(self):
        while True:
            try:
                items = await self._inner.next()
            except WorkerLost as lost:
                if self._heard or not self._retry(lost):
                    raise
                continue
            self._heard = True
            return items

    def _retry(self, lost: WorkerLost) -> bool:
        try:
            self.use(*self._replicas.send(self._generates, self._num_samples, frozenset(self._tried)))
        except EngineUnavailable:
            return False
        logger.info("request %s sent again, to replica %d: %s", self._generates[0].parent_id or
                    self._generates[0].request_id, self.replica, lost)
        return True

    def finish(self, request_id: str, reason: str) -> None:
        self._inner.finish(request_id, reason)

    def close(self) -> None:
        self._inner.close()


def check_alike(readies: Sequence[Ready], names: str | Sequence[str] = "replica") -> None:
    """Replicas of one model answer alike: refuse a set whose workers disagree on what the gateway
    tokenizes, hashes and bounds by. `names`: what the message calls worker k ("replica k"), or
    each worker's name."""
    names = [f"{names} {k}" for k in range(len(readies))] if isinstance(names, str) else names
    first = readies[0]
    for index, ready in enumerate(readies[1:], start=1):
        for field in ("model", "block_size", "hash_seed", "max_model_len", "vocab_size", "eos_token_ids"):
            if getattr(ready, field) != getattr(first, field):
                raise RuntimeError(f"{names[index]}'s worker differs from {names[0]}'s in {field}: "
                                   f"{getattr(ready, field)!r} against {getattr(first, field)!r}")
