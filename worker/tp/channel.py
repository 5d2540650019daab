"""What rank 0 of a tensor-parallel worker broadcasts to the other ranks (worker/tp/group.py),
in the order it runs it, so that every rank enters the same collectives in the same order.

    header [kind, payload bytes, extra]     int64, broadcast from rank 0
    payload                                 msgpack: the PackedStep, KvRead or KvWrite
    STEP      extra = fed tokens: the ids the step before sampled that the step feeds from the
              device (rows up to its largest source), broadcast after the payload
    KV_READ   the blocks (GPU or CPU-tier slots) whose KV rank 0 gathers from every rank
              (worker/tp/kv_shards.py)
    KV_WRITE  extra = bytes of the blocks broadcast after the payload, `[blocks, ranks, one
              rank's block bytes]`, each rank writing its own share into the slots named
    KV_COPY   copies between the GPU pool and the CPU tier that run outside a step (a step's
              own travel in its PackedStep)
    STOP      a header of zeros
"""

from __future__ import annotations

import msgspec
import torch
import torch.distributed as dist

from spillway.worker.core.readable_prefix import ReadablePrefix
from spillway.worker.core.step_plan import KVCopies
from spillway.worker.runner.executor import PackedStep

STOP, STEP, KV_READ, KV_WRITE, KV_COPY = 0, 1, 2, 3, 4


class KvRead(msgspec.Struct, frozen=True):
    """Rank 0 gathers the KV of `prefix`'s blocks, in its order, from every rank."""

    prefix: ReadablePrefix


class KvWrite(msgspec.Struct, frozen=True):
    """Every rank writes block i of the blocks that follow into its pool's `slots[i]`."""

    slots: list[int]


class KvCopy(msgspec.Struct, frozen=True):
    """Every rank runs these copies between its GPU pool and its CPU tier now."""

    copies: KVCopies


Message = PackedStep | KvRead | KvWrite | KvCopy


class RankChannel:
    """Rank 0's side sends, the other ranks' side receives; over the process group's device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._encoder = msgspec.msgpack.Encoder()
        self._decoders = {STEP: msgspec.msgpack.Decoder(PackedStep), KV_READ: msgspec.msgpack.Decoder(KvRead),
                          KV_WRITE: msgspec.msgpack.Decoder(KvWrite), KV_COPY: msgspec.msgpack.Decoder(KvCopy)}

    def send_step(self, step: PackedStep, fed_tokens: torch.Tensor | None) -> None:
        """On rank 0: the step, then the fed tokens it reads (rows up to its largest source)."""
        num_fed = max(step.feed_sources) + 1 if fed_tokens is not None else 0
        self._send(STEP, step, num_fed)
        if num_fed:
            dist.broadcast(fed_tokens[:num_fed].to(torch.int64).contiguous(), src=0)

    def send_kv_read(self, prefix: ReadablePrefix) -> None:
        self._send(KV_READ, KvRead(prefix), 0)

    def send_kv_write(self, slots: list[int], blocks: torch.Tensor) -> None:
        """On rank 0: the slots, then `blocks` (uint8 on the group's device, one row per slot)."""
        self._send(KV_WRITE, KvWrite(list(slots)), blocks.numel())
        dist.broadcast(blocks, src=0)

    def send_kv_copies(self, copies: KVCopies) -> None:
        self._send(KV_COPY, KvCopy(copies), 0)

    def stop(self) -> None:
        self._broadcast(torch.zeros(3, dtype=torch.int64))

    def receive(self) -> tuple[Message | None, torch.Tensor | None]:
        """On the other ranks: the next message and the tensor after it (a step's fed tokens, a
        write's blocks; on the device), or (None, None) to stop."""
        header = torch.zeros(3, dtype=torch.int64, device=self.device)
        dist.broadcast(header, src=0)
        kind, num_bytes, extra = header.tolist()
        if kind == STOP:
            return None, None
        payload = torch.empty(num_bytes, dtype=torch.uint8, device=self.device)
        dist.broadcast(payload, src=0)
        message = self._decoders[kind].decode(payload.cpu().numpy().tobytes())
        tensor = None
        if extra:
            tensor = torch.empty(extra, dtype=torch.int64 if kind == STEP else torch.uint8, device=self.device)
            dist.broadcast(tensor, src=0)
        return message, tensor

    def _send(self, kind: int, message: Message, extra: int) -> None:
        payload = self._encoder.encode(message)
        self._broadcast(torch.tensor([kind, len(payload), extra], dtype=torch.int64))
        self._broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8))

    def _broadcast(self, host_tensor: torch.Tensor) -> None:
        dist.broadcast(host_tensor.to(self.device), src=0)
