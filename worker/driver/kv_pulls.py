"""A consumer's requests held apart while their prompt's KV blocks are pulled from a producer
(disaggregated prefill and decode: protocol/kv_transfer.py), the checks an answer passes before
any of its blocks is taken, and the transfer counters Stats report.

    Engine.add_request ─ add ─▶ waiting ─ take_outgoing ─▶ KvPull sent (its deadline starts)
        ─▶ answered: the answer checked (`answer_problem`), its blocks adopted, the request
           released to the scheduler (or the constrained queue, its grammar's compile begun
           when it was added, so that the compile and the transfer overlap)
        ─▶ expired: no answer by the deadline; kv_load_failure_policy applies
        ─▶ abort: gone; an answer for it later finds nothing here and is dropped

No sockets here: the process's KV links (worker/kv_transfer/) send what `take_outgoing` hands
out and bring the answers to the engine.
"""

from __future__ import annotations

import logging
import math
import time
from concurrent.futures import Future
from dataclasses import dataclass

from spillway.protocol.config import WorkerConfig, setting_name
from spillway.protocol.kv_transfer import KvBlocks, KvPull
from spillway.protocol.local.drop_log import LOG_INTERVAL_S
from spillway.protocol.messages import BlockHash
from spillway.worker.core.request import Request
from spillway.worker.runner.kv_head_groups import can_regroup
from spillway.worker.runner.kv_block_io import KvLayout

logger = logging.getLogger(__name__)


def kv_transfer_refusal(config: WorkerConfig) -> str | None:
    """Why this worker cannot run its `kv_transfer` setting, or None."""
    kv = config.kv_transfer
    if kv is None:
        return None
    name = setting_name("kv_transfer_config", config.settings_spelling)
    if not config.enable_prefix_caching:
        # A producer serves blocks from its prefix cache, a consumer takes them into its own.
        return f"{name}: {kv.kv_role} needs prefix caching; turn {config.setting('enable_prefix_caching')} on"
    return None


@dataclass(slots=True)
class PendingPull:
    """A request waiting for the blocks it asked `address` for."""

    request: Request
    address: str  # the producer's KV server
    block_hashes: list[BlockHash]  # asked, in prompt order: from the first the consumer lacks
    sent: float = 0.0  # when handed out to be sent (monotonic); 0 until then
    deadline: float = math.inf
    # A constrained request's grammar compile and its deadline, begun while its blocks travel.
    compile: tuple[Future, float] | None = None


@dataclass(slots=True)
class KvTransferCounters:
    """Cumulative, for Stats: bytes pulled in and served, the seconds they took (a pull's from
    its sending to its blocks taken; a serve's gathering and sending), pulls failed."""

    bytes_received: int = 0
    bytes_sent: int = 0
    seconds_received: float = 0.0
    seconds_sent: float = 0.0
    failures: int = 0

    def received(self, num_bytes: int, seconds: float) -> None:
        self.bytes_received += num_bytes
        self.seconds_received += seconds

    def sent(self, num_bytes: int, seconds: float) -> None:
        self.bytes_sent += num_bytes
        self.seconds_sent += seconds


class KvPulls:
    """The requests waiting for their pulls, by request id (a pull's `transfer_id`)."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s  # a pull unanswered this long has failed
        self._waiting: dict[str, PendingPull] = {}
        self._unsent: list[PendingPull] = []
        self._last_warning = -math.inf
        self._unwarned = 0

    def __len__(self) -> int:
        return len(self._waiting)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._waiting

    def request_ids(self) -> list[str]:
        return list(self._waiting)

    def add(self, request: Request, address: str, block_hashes: list[BlockHash],
            compile: tuple[Future, float] | None = None) -> None:
        pending = PendingPull(request, address, block_hashes, compile=compile)
        self._waiting[request.request_id] = pending
        self._unsent.append(pending)

    def take_outgoing(self, now: float) -> list[tuple[str, KvPull]]:
        """(producer address, pull) of each request added since the last call; their deadlines
        start now."""
        outgoing = []
        for pending in self._unsent:
            if self._waiting.get(pending.request.request_id) is pending:  # not aborted meanwhile
                pending.sent, pending.deadline = now, now + self.timeout_s
                outgoing.append((pending.address, KvPull(transfer_id=pending.request.request_id,
                                                         block_hashes=pending.block_hashes)))
        self._unsent = []
        return outgoing

    def waiting_on(self, address: str) -> list[str]:
        """The request ids whose pulls wait for the producer at `address`."""
        return [request_id for request_id, pending in self._waiting.items() if pending.address == address]

    def answered(self, transfer_id: str) -> PendingPull | None:
        """The pull `transfer_id` answers, no longer waiting; None when none waits (aborted,
        failed, or answered before)."""
        return self._waiting.pop(transfer_id, None)

    def expired(self, now: float) -> list[PendingPull]:
        """The pulls past their deadline, no longer waiting."""
        gone = [pending for pending in self._waiting.values() if pending.deadline < now]
        for pending in gone:
            del self._waiting[pending.request.request_id]
        return gone

    def seconds_to_deadline(self, now: float) -> float:
        """Until the first deadline (inf when no pull has been sent)."""
        return min((pending.deadline for pending in self._waiting.values()), default=math.inf) - now

    def abort(self, request_ids: list[str]) -> list[Request]:
        """The requests of `request_ids` still waiting, dropped."""
        return [self._waiting.pop(request_id).request for request_id in request_ids if request_id in self._waiting]

    def warn(self, message: str) -> None:
        """A warning, at most one line per LOG_INTERVAL_S with the count of those held back: a
        producer gone fails every pull sent to it."""
        self._unwarned += 1
        now = time.monotonic()
        if now - self._last_warning >= LOG_INTERVAL_S:
            more = f" ({self._unwarned - 1} more like it since the last)" if self._unwarned > 1 else ""
            logger.warning("%s%s", message, more)
            self._last_warning, self._unwarned = now, 0


def answer_problem(answer: KvBlocks, asked: list[BlockHash], payload_bytes: int | None, model: str,
                   layout: KvLayout, num_kv_heads: int) -> str | None:
    """Why the blocks of `answer` cannot be taken into this worker's pool, or None: a producer
    of another tensor-parallel size is fine (its heads are regrouped, worker/runner/kv_head_groups.py).
    `payload_bytes`: the size of the frame after the answer; None when it came with another
    number of frames than one; `num_kv_heads`: the model's."""
    if answer.error:
        return f"the producer refused the pull: {answer.error}"
    if payload_bytes is None:
        return "the answer did not come as two frames (the answer, then its blocks)"
    if answer.model != model:
        return f"its blocks are of model {answer.model!r}; this worker runs {model!r}"
    if answer.dtype != layout.dtype or not (tuple(answer.block_shape) == layout.block_shape
                                            or can_regroup(answer.block_shape, layout.block_shape, num_kv_heads)):
        return (f"its blocks are {answer.dtype} {list(answer.block_shape)}; this worker's are {layout.dtype} "
                f"{list(layout.block_shape)}")
    if answer.block_hashes != asked[:len(answer.block_hashes)]:
        return "it answered with block hashes that are not a prefix of those asked"
    block_bytes = math.prod(answer.block_shape) * layout.itemsize
    if payload_bytes != len(answer.block_hashes) * block_bytes:
        return f"it sent {payload_bytes} bytes for {len(answer.block_hashes)} blocks of {block_bytes} bytes each"
    return None
