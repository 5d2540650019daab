"""The worker's heartbeat: a thread that tells every gateway, every BEAT_INTERVAL_S, that this
process lives, and how long its busy loop has been in its current stage.

    busy loop:    beat.stage_started() -> take messages in -> beat.stage_started() -> step, send
    beat thread:  StepOutputs(step=-1, outputs=[], iteration_s=now - stage start), on sockets of its own

The busy loop reads its inbox only between steps, and one step may run for seconds (a CPU
prefill of thousands of tokens, the first step of a shape that compiles): a probe sent to the
inbox goes unanswered meanwhile. The thread beats through such a step, since the step's kernels
and copies release the GIL. A stopped (SIGSTOP) or frozen process beats no more, and a step
stuck for good shows in `iteration_s`: the gateway judges both (gateway/link/worker_link.py).

The thread owns its sockets (ZeroMQ sockets are not shared between threads): one PUSH per
link, connected to the link's outbox beside the loop's own; the gateway's PULL takes from both.
A beat that cannot go at once (no gateway there yet) is dropped, never queued.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import zmq

from spillway.protocol.local.link_auth import LinkKeys
from spillway.protocol.messages import HEARTBEAT_INTERVAL_S, StepOutputs, encoder

BEAT_INTERVAL_S = HEARTBEAT_INTERVAL_S  # the protocol's: the gateway counts missed beats


class Heartbeat:
    """The beat thread and the busy loop's mark of its current stage (the wait for messages,
    bounded by the loop's poll timeout, or one step, bounded by nothing)."""

    def __init__(self, ctx: zmq.Context, outboxes: Sequence[str], keys: LinkKeys | None = None,
                 interval_s: float = BEAT_INTERVAL_S) -> None:
        self._ctx = ctx
        self._outboxes = list(outboxes)
        self._keys = keys
        self._interval_s = interval_s
        # Written by the busy loop, read by the thread: a float store is atomic under the GIL.
        self._stage_started = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="spillway-heartbeat", daemon=True)

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def stage_started(self) -> None:
        self._stage_started = time.monotonic()

    def stop(self) -> None:
        """End the thread and close its sockets (before the context is destroyed)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)

    def _run(self) -> None:
        socks = []
        for address in self._outboxes:
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 4)  # a gateway that does not read gets no backlog of beats
            if self._keys is not None:
                self._keys.secure_worker_socket(sock)
            sock.connect(address)
            socks.append(sock)
        enc = encoder()
        try:
            while not self._stop.wait(self._interval_s):
                beat = enc.encode(StepOutputs(step=-1, outputs=[],
                                              iteration_s=time.monotonic() - self._stage_started))
                for sock in socks:
                    try:
                        sock.send(beat, zmq.NOBLOCK)
                    except zmq.Again:
                        pass
        finally:
            for sock in socks:
                sock.close()
