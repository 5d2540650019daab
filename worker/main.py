"""The worker process: handshake, then a busy loop over ZeroMQ.

    drain inboxes (Generate | Abort | Control) -> engine.step() -> push StepOutputs to each link

(with work in flight, an iteration takes messages in for at most the engine's drain budget, or
its landing drain budget while nothing can compute before loads from the CPU tier land; both
scale with the model's step: worker/driver/timing.py).

The gateway binds both sockets; the worker connects, so a worker on another host only
needs the gateway's address (and, off loopback, the link's key: protocol/local/link_auth.py).
With several API servers on one port (`--api-server-count`), each is a link of its own
(worker/gateway_links.py). A message that does not decode is logged (rate-limited) and dropped.
A thread beats to every link meanwhile, through long steps too (worker/heartbeat.py).
With `WorkerConfig.kv_events`, each iteration's report of the prefix cache's changes
(`Engine.take_kv_events`) reaches every link once, and a gateway attaching anew the whole set.
With `WorkerConfig.kv_transfer` (disaggregated prefill and decode), the worker's KV sockets
(worker/kv_transfer/) are polled with the links: a producer answers pulls between its steps,
idle or not; a consumer sends the pulls of the requests it received after each intake, and while
only pulls are awaited waits in the poll, up to the first pull's deadline.
"""

from __future__ import annotations

import gc
import logging
import math
import os
import sys
import time
import traceback
from collections.abc import Sequence

import msgspec
import zmq

from spillway.protocol.config import WorkerConfig, exit_when_gateway_closes, read_launch
from spillway.protocol.local.drop_log import DropLog
from spillway.protocol.local.envs import step_trace_path, worker_key
from spillway.protocol.local.link_auth import LinkKeyError, LinkKeys, read_worker_key, require_key_off_loopback
from spillway.protocol.messages import (
    Abort,
    Control,
    ControlCommand,
    Generate,
    KvSourceLost,
    Ready,
    RequestDelta,
    StepOutputs,
    WorkerError,
    encoder,
    gateway_decoder,
)
from spillway.worker.compile_log import log_late_compiles
from spillway.worker.driver.engine import Engine
from spillway.worker.gateway_links import GatewayLinks
from spillway.worker.heap import HeapTrimmer
from spillway.worker.heartbeat import Heartbeat
from spillway.worker.kv_transfer.links import KvLinks
from spillway.worker.kv_transfer.setup import kv_server_address, start_note
from spillway.worker.driver.stats import step_tokens
from spillway.worker.step_trace import StepTrace

logger = logging.getLogger("spillway.worker")

STATS_INTERVAL_S = 0.5
IDLE_POLL_MS = 1000
# With nothing to compute until a load from the CPU tier lands (a 10k-token prefix takes
# ~27 ms on the H200), the inbox is polled between checks of the device, not in a spin: for the
# shortest wait a poll takes (whole milliseconds).
LANDING_POLL_MS = 1


def local_main() -> int:
    """`python -m spillway.worker`: a worker started by a gateway or `LLM` on this host
    (gateway/link/worker_process.py), or by a Ray replica's actor on any node
    (gateway/replicas/worker_host.py). Its configuration arrives on stdin as msgpack, never
    pickled; the pipe's EOF (its starter gone) ends the process, even mid-load."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    launch = read_launch(sys.stdin.fileno())
    exit_when_gateway_closes(sys.stdin.fileno())
    try:
        keys = link_keys(launch.inbox)
    except LinkKeyError as exc:
        logger.error("worker failed to start: %s", exc)
        return 1
    return run_worker(launch.config, launch.inbox, launch.outbox, launch.parent_pid, keys=keys,
                      extra_links=launch.extra_links)


def link_keys(inbox: str) -> LinkKeys | None:
    """An ipc:// link, in the gateway's 0700 folder, is not keyed. A tcp:// one reaches a gateway
    on another host (a Ray replica's actor started this worker there): keyed by
    SPILLWAY_WORKER_KEY, as `spillway worker --connect` is, and refused off loopback without it."""
    if not inbox.startswith("tcp://"):
        return None
    keys = read_worker_key(None, worker_key())
    require_key_off_loopback(inbox, keys)
    return keys


def run_worker(config: WorkerConfig, inbox: str, outbox: str, parent_pid: int | None = None,
               keys: LinkKeys | None = None, extra_links: Sequence[tuple[str, str]] = ()) -> int:
    """Serve the gateway at (inbox, outbox) and the API servers at `extra_links` until a
    SHUTDOWN, the gateway's exit, or a failure (exit status 1)."""
    ctx = zmq.Context()
    links = GatewayLinks(ctx, [(inbox, outbox), *extra_links], keys)
    enc = encoder()
    kv: KvLinks | None = None
    try:
        engine = Engine(config, defer_release=True)  # freed after the sends (Engine.release_finished)
        if config.kv_transfer is not None:
            kv = kv_links(ctx, engine, config, inbox, keys, links)
    except Exception as exc:  # report why, then exit: the gateway raises it to the user
        if isinstance(exc, ValueError):  # a setting the model or the device cannot take: the message says it
            logger.error("worker failed to start: %s", exc)
        else:
            logger.exception("worker failed to start")
        links.send_all(enc.encode(WorkerError(message=str(exc), fatal=True, traceback=traceback.format_exc())))
        ctx.destroy(linger=2000)
        return 1
    # What start-up built (model, tensors, modules) lives as long as the process: move it out
    # of the collector's reach, so a collection mid-run scans only what steps allocate.
    gc.collect()
    gc.freeze()
    ready = msgspec.structs.replace(engine.ready(kv.address if kv is not None else ""), worker_session=os.urandom(8))
    if engine.device.type == "cuda":
        log_late_compiles()
    links.send_all(enc.encode(ready))
    beat = Heartbeat(ctx, links.outbox_addresses, links.keys).start()
    try:
        _busy_loop(engine, ready, links, parent_pid, beat, kv)
    except Exception as exc:
        logger.exception("worker step failed")
        links.send_all(enc.encode(WorkerError(message=f"worker failed: {exc}", fatal=True,
                                              traceback=traceback.format_exc())))
        return 1
    finally:
        beat.stop()
        if kv is not None:
            kv.close()
        engine.close()
        ctx.destroy(linger=2000)
    return 0


def kv_links(ctx: zmq.Context, engine: Engine, config: WorkerConfig, inbox: str, keys: LinkKeys | None,
             links: GatewayLinks) -> KvLinks:
    """The worker's KV sockets, polled with `links`: its server bound when it produces. Over
    tcp:// they are keyed by the worker link's secret, or by SPILLWAY_WORKER_KEY for a worker
    whose own link is not keyed (a local one)."""
    kv = config.kv_transfer
    if keys is None:
        keys = read_worker_key(None, worker_key())
    server_address = kv_server_address(kv, inbox) if kv.produces else None
    links_kv = KvLinks(ctx, engine, server_address, keys, watch=links.watch)
    logger.info(start_note(kv, links_kv.address))
    return links_kv


def _poll_timeout_ms(engine: Engine) -> int:
    """How long the busy loop waits for messages before its next step."""
    if not engine.has_work:
        # Idle: the CPU tier writes cached blocks back meanwhile, a batch per poll.
        return LANDING_POLL_MS if engine.idle_write_back() else IDLE_POLL_MS
    if engine.waits_for_loads:
        return LANDING_POLL_MS
    if engine.waits_for_pulls:  # an answer ends the wait; its deadline, at the latest
        return math.ceil(min(IDLE_POLL_MS, engine.kv_pull_wait_s() * 1000))
    return 0


def _busy_loop(engine: Engine, ready: Ready, links: GatewayLinks, parent_pid: int | None, beat: Heartbeat,
               kv: KvLinks | None = None) -> None:
    enc, dec = encoder(), gateway_decoder()
    step = 0
    last_stats = 0.0
    busy_before = False
    drops = DropLog(logger, "from the gateway")
    trace = StepTrace(path) if (path := step_trace_path()) else None
    # On the CPU the linear layers' per-shape kernels churn glibc's heap (worker/heap.py).
    trimmer = HeapTrimmer() if engine.device.type == "cpu" else None
    iteration_tokens: list[int] = []  # each step's tokens, until the next Stats carries them
    while True:
        beat.stage_started()
        pending: list[RequestDelta] = []
        want_stats = check_invariants = False
        received = 0
        timeout = _poll_timeout_ms(engine)
        landing = engine.waits_for_loads
        budget = engine.timing.landing_drain_budget_s if landing else engine.timing.drain_budget_s
        landed = engine.awaited_load_landed if landing else None  # a landing ends the intake at once
        for link, data in links.take(timeout, lambda: engine.has_work, budget, landed):
            try:
                msg = dec.decode(data)
            except msgspec.DecodeError as exc:
                drops.drop(f"{len(data)} bytes that do not decode: {exc}")
                continue
            match msg:
                case Generate() as msg:
                    received += 1
                    links.admit(msg.request_id, link)
                    error = engine.add_request(msg)
                    if error is not None:
                        pending.append(error)
                case Abort(request_ids=request_ids):
                    pending.extend(engine.abort(request_ids))
                case KvSourceLost(address=address):
                    pending.extend(engine.kv_source_lost(address))
                case Control(command=ControlCommand.SHUTDOWN) if link == 0:  # from the gateway that owns it
                    return
                case Control(command=ControlCommand.HELLO, session=session):
                    if session != links.sessions[link]:
                        # A new gateway on this link: what the one before asked for has no one to go to.
                        pending = _forget_link(engine, links, link, pending)
                        links.sessions[link] = session
                        links.outboxes[link].send(enc.encode(ready))
                        if (snapshot := engine.kv_events_snapshot()) is not None:  # it heard none before
                            links.outboxes[link].send(enc.encode(StepOutputs(step=step, outputs=[],
                                                                             kv_events=snapshot)))
                case Control(command=ControlCommand.RESET_PREFIX_CACHE):
                    engine.reset_prefix_cache()
                    want_stats = True
                case Control(command=ControlCommand.CHECK_INVARIANTS):
                    want_stats = check_invariants = True
                case Control():
                    want_stats = True
        if kv is not None:
            kv.send_pulls()  # of the requests just received: their deadlines start
            pending.extend(kv.take_deltas())
        if parent_pid is not None and os.getppid() != parent_pid:
            logger.warning("the gateway process is gone; worker exiting")
            return
        was_busy = engine.has_work
        if was_busy:
            beat.stage_started()
            started = time.perf_counter()
            deltas = engine.step()
            if trace is not None:
                trace.record(started, time.perf_counter(), received, engine, deltas)
            pending.extend(deltas)
            if num_tokens := step_tokens(engine.last_plan, deltas):
                iteration_tokens.append(num_tokens)
        now = time.monotonic()
        if was_busy and not engine.has_work:
            want_stats = True  # the gateway sees the idle state right away
        if trimmer is not None and was_busy:
            trimmer.maybe_trim(went_idle=not engine.has_work)
        if was_busy and (not busy_before or now - last_stats >= STATS_INTERVAL_S):
            want_stats = True  # and a busy one from its first step on
        busy_before = engine.has_work
        # Every link hears each report of the prefix cache's changes once: with its outputs,
        # else with the stats, else alone. Releasing the finished requests' blocks below
        # changes no hash (they stay cached), so nothing is left for the next report.
        kv_events = engine.take_kv_events()
        routed = links.route(pending)
        for out, outputs in zip(links.outboxes, routed):
            if outputs or (kv_events is not None and not want_stats):
                out.send(enc.encode(StepOutputs(step=step, outputs=outputs, kv_events=kv_events)))
        # The blocks of the requests that finished go back once their last tokens are on their
        # way, and before the stats count them.
        engine.release_finished()
        if want_stats:
            stats = msgspec.structs.replace(engine.stats(check_invariants), iteration_tokens=iteration_tokens)
            iteration_tokens = []
            last_stats = now
            for out, outputs in zip(links.outboxes, routed):  # every gateway hears the worker's stats
                out.send(enc.encode(StepOutputs(step=step, outputs=[], stats=stats,
                                                kv_events=None if outputs else kv_events)))
        if pending or want_stats or kv_events is not None:
            step += 1


def _forget_link(engine: Engine, links: GatewayLinks, link: int, pending: list[RequestDelta]) -> list[RequestDelta]:
    """Abort the requests of `link`, whose gateway is new: their deltas have no one to go to.
    Returns the outputs still pending for the other links."""
    if len(links) == 1:
        aborted, kept = engine.abort_all(), []
    else:
        owned = links.forget(link)
        aborted = len(engine.abort(owned))
        gone = set(owned)
        kept = [delta for delta in pending if delta.request_id not in gone]
    if aborted:
        logger.info("a new gateway attached: %d requests of the one before aborted", aborted)
    return kept
