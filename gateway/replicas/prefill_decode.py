"""Disaggregated prefill and decode behind one gateway (`--prefill-workers N --decode-workers M`):
the client the routes and `LLM` use then, with EngineClient's interface.

    submit ─▶ producers (a ReplicaSet routing by prefix): each prompt once, its Generate with
    │         max_tokens 1 and nothing asked of the output, id "<its first sample's id>-prefill";
    │         the one token that comes back is dropped, its blocks stay in the producer's cache
    └─ a prompt's prefill finished ─▶ consumers (a ReplicaSet, least loaded; the same one for the
              request's later prompts): the prompt's samples as the client sent them, with
              kv_source = the producer's Ready.kv_address; the consumer pulls the prompt's
              blocks from there, computes the rest and decodes
    the client's stream carries the consumer's deltas only: text, usage, finish reasons and
    logprobs all come from the decode side

A prompt shorter than one block has no block to pull: it goes to the consumer at once. So does
every prompt while no producer is ready (a consumer computes a whole prompt as any engine does):
a producer's restart slows requests down rather than refusing them.

No wait outlives a worker: each side's EngineClient puts WorkerLost (or WorkerTimeout) on the
request's side (`_Side.put`), which aborts whatever the other side holds and ends the request.
Engines are numbered producers first (the metrics' `engine` label): 0 .. N-1, then N .. N+M-1.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

import msgspec

from spillway.gateway.link.client import (DeltaInbox, EngineClient, EngineOverloaded, EngineUnavailable, WorkerLost,
                                          WorkerTimeout)
from spillway.gateway.replicas.merged_stats import merge_stats
from spillway.gateway.replicas.replica_set import ReplicaSet, check_alike
from spillway.protocol.messages import FinishReason, Generate, KvSource, Ready, RequestDelta, Stats

logger = logging.getLogger("spillway.gateway")

PREFILL_SUFFIX = "-prefill"
PRODUCER_ROLES = ("kv_producer", "kv_both")
CONSUMER_ROLES = ("kv_consumer", "kv_both")


def prefill_request(generate: Generate) -> Generate:
    """The producer's copy of a prompt's request: its prompt, blocks, salt, priority and client
    request, one token and nothing the client asked of the output (the KV depends on the tokens
    alone)."""
    params = msgspec.structs.replace(generate.params, max_tokens=1, min_tokens=0, logprobs=None, prompt_logprobs=None,
                                     structured=None, ignore_eos=True)
    return msgspec.structs.replace(generate, request_id=generate.request_id + PREFILL_SUFFIX, params=params,
                                   thinking=None, kv_source=None)


class PrefillDecodeSet:
    """Producer and consumer workers behind one gateway, as one engine."""

    def __init__(self, producer_starts: Sequence[Callable[[], object]], consumer_starts: Sequence[Callable[[], object]],
                 *, max_num_seqs: int, routing: str = "prefix", metrics=None, sequential_start: bool = False,
                 **client_options) -> None:
        """`routing`: how prompts spread over the producers (gateway/replicas/router.py); the
        consumers take the least loaded. `sequential_start`: every worker after the one before
        (they share a GPU), producers first."""
        self._sequential_start = sequential_start
        self.producers = ReplicaSet(producer_starts, routing=routing, max_num_seqs=max_num_seqs, metrics=metrics,
                                    sequential_start=sequential_start, name="prefill",
                                    on_replica_lost=self._producer_lost, **client_options)
        self.consumers = ReplicaSet(consumer_starts, routing="load", max_num_seqs=max_num_seqs, metrics=metrics,
                                    sequential_start=sequential_start, first_engine=len(producer_starts),
                                    name="decode", **client_options)
        self._ready_seen: Ready | None = None
        self._ready_view: Ready | None = None
        self._prefilling_locally = False  # no producer was ready for the last request

    # ---- the EngineClient interface ------------------------------------------------------------

    async def start(self) -> Ready:
        if self._sequential_start:
            await self.producers.start()
            await self.consumers.start()
        else:
            await asyncio.gather(self.producers.start(), self.consumers.start())
        self._check_workers()
        return self.ready

    async def close(self) -> None:
        await asyncio.gather(self.producers.close(), self.consumers.close())

    @property
    def ready(self) -> Ready:
        """A consumer's Ready, without a KV role or address: the set as one engine takes no
        kv_transfer_params of the two-server form (its prompts go through its own producers)."""
        ready = self.consumers.ready
        if ready is not self._ready_seen:
            self._ready_seen = ready
            self._ready_view = msgspec.structs.replace(ready, kv_address="", kv_role="")
        return self._ready_view

    @property
    def healthy(self) -> bool:
        """A consumer can take requests (without a producer it computes whole prompts)."""
        return self.consumers.healthy

    @property
    def num_in_flight(self) -> int:
        return self.producers.num_in_flight + self.consumers.num_in_flight

    @property
    def lost_reason(self) -> str | None:
        return self.consumers.lost_reason or self.producers.lost_reason

    @property
    def last_stats(self) -> Stats | None:
        reports = [client.last_stats for client in self._clients() if client.last_stats is not None]
        return merge_stats(reports) if reports else None

    def submit(self, generates: list[Generate], num_samples: int = 1) -> PrefillDecodeStream:
        """Send one HTTP request's sub-requests (`num_samples` consecutive ones per prompt):
        through a producer, then to a consumer. Raises EngineUnavailable / EngineOverloaded."""
        if not self.consumers.healthy:
            raise EngineUnavailable("the engine is not ready: no decode worker is running")
        stream = PrefillDecodeStream(self, num_samples)
        try:
            stream.start(generates)
        except BaseException:
            stream.close()
            raise
        return stream

    def worker_states(self) -> list[tuple[str, str]]:
        """(role, link state) of each worker, in engine order: producers, then consumers."""
        return [("kv_producer", state) for state in self.producers.replica_states()] + \
               [("kv_consumer", state) for state in self.consumers.replica_states()]

    async def refresh_stats(self, timeout_s: float = 1.0) -> Stats | None:
        await asyncio.gather(self.producers.refresh_stats(timeout_s), self.consumers.refresh_stats(timeout_s))
        return self.last_stats

    async def stats(self, timeout_s: float | None = None, check_invariants: bool = False) -> Stats:
        if not self.consumers.healthy:
            raise EngineUnavailable("the engine is not ready: no decode worker is running")
        live = [client for client in self._clients() if client.healthy]
        return merge_stats(await asyncio.gather(*(client.stats(timeout_s, check_invariants) for client in live)))

    def reset_prefix_cache(self) -> None:
        if not self.consumers.healthy:
            raise EngineUnavailable("the engine is not ready: no decode worker is running")
        for client in self._clients():
            if client.healthy:
                client.reset_prefix_cache()

    def send_prefills(self, prefills: list[Generate], side: _Side) -> bool:
        """Route a request's prefills to a producer; False when none is ready (the consumer then
        computes the prompts itself)."""
        try:
            side.index, _ = self.producers.send(prefills, 1, stream=side)
        except EngineUnavailable:
            if not self._prefilling_locally:
                logger.warning("no prefill worker is ready (%s): decode workers compute whole prompts until one is",
                               self.producers.lost_reason or "starting")
            self._prefilling_locally = True
            return False
        if self._prefilling_locally:
            logger.info("a prefill worker is ready again: prompts go through the prefill workers")
        self._prefilling_locally = False
        side.client = self.producers.replicas[side.index]
        return True

    def send_decodes(self, generates: list[Generate], num_samples: int, side: _Side,
                     excluded: frozenset[int] = frozenset()) -> None:
        """A request's decodes to its consumer: the least loaded one not `excluded` for the
        side's first, the same one after."""
        if side.client is None:
            side.index, _ = self.consumers.send(generates, num_samples, excluded, stream=side)
            side.client = self.consumers.replicas[side.index]
        else:
            side.client.submit(generates, num_samples, side)

    # ---- internals ---------------------------------------------------------------------------

    def _producer_lost(self, index: int) -> None:
        """A producer's worker is gone: the consumers' pulls from it fail now, by their
        kv_load_failure_policy (an error, or the prompt computed), rather than when their answer
        is overdue."""
        address = self.producers.replicas[index].ready.kv_address if self.producers.replicas[index].ready else ""
        if address:
            for consumer in self.consumers.replicas:
                consumer.kv_source_lost(address)

    def _clients(self) -> list[EngineClient]:
        return [*self.producers.replicas, *self.consumers.replicas]

    def _check_workers(self) -> None:
        """One model on every worker, and each worker in its role: a producer serving its blocks
        (a KV server's address), a consumer pulling them."""
        names = [f"prefill {k}" for k in range(len(self.producers.replicas))] + \
                [f"decode {k}" for k in range(len(self.consumers.replicas))]
        readies = [client.ready for client in self._clients()]
        check_alike(readies, names)
        for name, ready in zip(names, readies):
            producer = name.startswith("prefill")
            if ready.kv_role not in (PRODUCER_ROLES if producer else CONSUMER_ROLES):
                raise RuntimeError(f"{name}'s worker has the KV transfer role {ready.kv_role or 'none'!r}; it was "
                                   f"started as {'kv_producer' if producer else 'kv_consumer'} (a worker without "
                                   "disaggregated prefill and decode reports none)")
            if producer and not ready.kv_address:
                raise RuntimeError(f"{name}'s worker reports no KV server (Ready.kv_address): consumers could "
                                   "not pull its blocks")


class _Side:
    """A request's sub-requests on one worker: its EngineClient routes their deltas here (`put`)
    and drops their ids from `open_ids` as they end."""

    def __init__(self, on_item: Callable[[_Side, RequestDelta | WorkerLost], None]) -> None:
        self.client: EngineClient | None = None  # the worker's client, once the request is sent there
        self.index = -1  # that worker's index among its role's
        self.open_ids: set[str] = set()
        self._on_item = on_item

    def put(self, item: RequestDelta | WorkerLost) -> None:
        self._on_item(self, item)

    def abort(self, reason: str = "abort") -> None:
        if self.open_ids:
            self.client.abort(list(self.open_ids), reason)


class PrefillDecodeStream:
    """One HTTP request's deltas, from its decode side, with RequestStream's interface; its prompts
    pass through a producer first. If the consumer's worker is lost before anything of the
    request came back from it, the decodes go to another consumer (once per consumer), as a
    replica set's requests do: the blocks are still in the producer's cache."""

    def __init__(self, workers: PrefillDecodeSet, num_samples: int) -> None:
        self._workers = workers
        self._num_samples = num_samples
        self._inbox = DeltaInbox()
        self._prefill = _Side(self._on_prefill)
        self._decode = _Side(self._on_decode)
        self._awaiting: dict[str, list[Generate]] = {}  # a prefill's id -> its prompt's samples, not yet sent on
        self._decoding: list[Generate] = []  # the decodes sent, as sent (to send again elsewhere)
        self._tried: set[int] = set()  # the consumers the decodes went to
        self._heard = False  # a delta came back from the decode side
        self._ended = False  # failed or closed: nothing more is sent to either side

    def start(self, generates: list[Generate]) -> None:
        n = self._num_samples
        prompts = [generates[k:k + n] for k in range(0, len(generates), n)]
        staged = [prompt for prompt in prompts if prompt[0].block_hashes]
        direct = [prompt for prompt in prompts if not prompt[0].block_hashes]  # no whole block to pull
        if staged:
            prefills = [prefill_request(prompt[0]) for prompt in staged]
            if self._workers.send_prefills(prefills, self._prefill):
                self._awaiting = {prefill.request_id: prompt for prefill, prompt in zip(prefills, staged)}
            else:
                direct = prompts
        if direct:
            self._send_decodes([g for prompt in direct for g in prompt])

    @property
    def open_ids(self) -> set[str]:
        """The client's sub-requests not yet finished, on either side."""
        return self._decode.open_ids | {g.request_id for samples in self._awaiting.values() for g in samples}

    @property
    def num_tracked(self) -> int:
        """Sub-requests this stream still holds anywhere: prefills, samples waiting on them, decodes."""
        return len(self._prefill.open_ids) + len(self._decode.open_ids) + sum(map(len, self._awaiting.values()))

    async def next(self) -> list[RequestDelta]:
        """Every decode delta that has arrived, waiting for at least one; raises WorkerLost."""
        return await self._inbox.take()

    def finish(self, request_id: str, reason: str) -> None:
        """The gateway ended this sample itself (a stop string): stop it where it runs."""
        if request_id in self._decode.open_ids:
            self._decode.client.abort([request_id], reason)
            return
        for prefill_id, samples in self._awaiting.items():
            kept = [g for g in samples if g.request_id != request_id]
            if len(kept) < len(samples):
                self._awaiting[prefill_id] = kept
                if not kept:  # no sample of this prompt is left to decode
                    del self._awaiting[prefill_id]
                    if prefill_id in self._prefill.open_ids:
                        self._prefill.client.abort([prefill_id])
                return

    def close(self) -> None:
        """Abort whatever is still running, on both sides (the client went away, or the handler
        ended); nothing is sent on afterwards."""
        self._ended = True
        self._awaiting.clear()
        self._prefill.abort()
        self._decode.abort()

    # ---- called by the sides' clients -----------------------------------------------------------

    def _on_prefill(self, side: _Side, item: RequestDelta | WorkerLost) -> None:
        if isinstance(item, WorkerLost):
            self._fail(type(item)(f"the prefill worker: {item}"))
            return
        if item.finish_reason is None or self._ended:
            return  # its one token, before the finish; or the request is over
        samples = self._awaiting.pop(item.request_id, None)
        if not samples:
            return
        if item.finish_reason in (FinishReason.ERROR, FinishReason.ABORT):
            for generate in samples:  # the client's samples end as the prefill did
                self._put(RequestDelta(request_id=generate.request_id, new_token_ids=[],
                                       finish_reason=item.finish_reason, error=item.error))
            return
        address = side.client.ready.kv_address
        if address:
            samples = [msgspec.structs.replace(g, kv_source=KvSource(address=address)) for g in samples]
        try:
            self._send_decodes(samples)
        except (EngineUnavailable, EngineOverloaded) as exc:
            self._fail(WorkerLost(f"no decode worker took the prefilled request: {exc}"))

    def _on_decode(self, side: _Side, item: RequestDelta | WorkerLost) -> None:
        if side is not self._decode:
            return  # a consumer this request has left (its loss reported once per sub-request)
        if isinstance(item, WorkerLost):
            if not self._heard and self._send_again(item):
                return
            self._fail(type(item)(f"the decode worker: {item}"))
            return
        self._heard = True
        self._put(item)

    def _send_decodes(self, generates: list[Generate]) -> None:
        self._workers.send_decodes(generates, self._num_samples, self._decode)
        self._decoding += generates
        self._tried.add(self._decode.index)

    def _send_again(self, lost: WorkerLost) -> bool:
        """The decodes to another consumer, their first one lost before answering; False when none
        can take them."""
        if self._ended or isinstance(lost, WorkerTimeout):
            return False
        self._decode = _Side(self._on_decode)
        try:
            self._workers.send_decodes(self._decoding, self._num_samples, self._decode, frozenset(self._tried))
        except (EngineUnavailable, EngineOverloaded):
            return False
        self._tried.add(self._decode.index)
        logger.info("request %s sent again, to decode %d: %s", self._decoding[0].parent_id or
                    self._decoding[0].request_id, self._decode.index, lost)
        return True

    def _fail(self, lost: WorkerLost) -> None:
        """One side's worker is gone (or silent past the bound): the other side's part is
        aborted, and the request ends with the error."""
        if self._ended:
            return
        self.close()
        self._put(lost)

    def _put(self, item: RequestDelta | WorkerLost) -> None:
        self._inbox.put(item)
