"""The logical KV block, a request's table of them, and the intrusive LRU list that orders the
cached ones for eviction."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from spillway.protocol.messages import BlockHash


@dataclass(slots=True, eq=False)
class Block:
    """A logical block: a unit of a request's tokens and, once full and computed, of the
    prefix cache. Its KV lives in a GPU slot, a CPU slot, both or (while free) neither; a slot
    is a row of that tier's KV pool and says nothing about the block id."""

    block_id: int
    gpu_slot: int | None = None
    cpu_slot: int | None = None
    ref_count: int = 0
    block_hash: BlockHash | None = None
    # The CPU tier's load batch bringing its KV into its GPU slot; 0 when none is planned or on
    # its way (worker/core/cpu_slots.py sets and clears it).
    load_batch: int = 0
    # Links of the LRU list; both None exactly when the block is not in it.
    lru_prev: Block | None = field(default=None, repr=False)
    lru_next: Block | None = field(default=None, repr=False)


@dataclass(slots=True)
class BlockTable:
    """A request's blocks, in token order."""

    blocks: list[Block]
    # [block.gpu_slot for block in blocks], kept as it grows so `slot_table` is one list copy:
    # a referenced block's GPU slot never changes.
    slots: list[int]
    # Leading blocks already reported full by `commit` (or taken as cache hits).
    num_committed: int = 0
    # The last load batch bringing one of its hits to the GPU when it took them (0: none).
    load_batch: int = 0


class BlockLRU:
    """Intrusive doubly-linked list of blocks with O(1) append, pop and removal.

    Head: evicted next; tail: released last. The links live in the blocks, so removing a
    block that a prefix lookup hit needs no search.
    """

    def __init__(self) -> None:
        self._head = Block(block_id=-1)  # sentinels: no None checks when linking
        self._tail = Block(block_id=-1)
        self._head.lru_next, self._tail.lru_prev = self._tail, self._head
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Block]:
        block = self._head.lru_next
        while block is not self._tail:
            yield block
            block = block.lru_next

    def append(self, block: Block) -> None:
        if block.lru_prev is not None:
            raise ValueError(f"block {block.block_id} is already in the LRU list")
        before, after = self._tail.lru_prev, self._tail
        block.lru_prev, block.lru_next = before, after
        before.lru_next = after.lru_prev = block
        self._len += 1

    def popleft(self) -> Block:
        if self._len == 0:
            raise IndexError("the LRU list is empty")
        block = self._head.lru_next
        self.remove(block)
        return block

    def remove(self, block: Block) -> None:
        if block.lru_prev is None:
            raise ValueError(f"block {block.block_id} is not in the LRU list")
        block.lru_prev.lru_next, block.lru_next.lru_prev = block.lru_next, block.lru_prev
        block.lru_prev = block.lru_next = None
        self._len -= 1
