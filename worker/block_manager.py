"""KV blocks, reference counts and the prefix cache: pure bookkeeping over integer ids.

Every block is in exactly one of two states:

    referenced   ref_count > 0    in the block table of ref_count requests
    free         ref_count == 0   in the free list; it may still hold a hash, and then it is a
                                  prefix-cache entry that a lookup can hit until it is reused

The free list is the LRU order of eviction, threaded through the blocks themselves:

    head (evicted next)                                        tail (freed last)
     [9] <-> [4] <-> [2] <-> [7] <-> [6]
     no hash          h(a,b)   h(a)    ...

Allocation pops the head and drops the hash it held (lazy eviction). A released request's
hashed blocks are appended tail-first (last block first), so among them the block covering
the most tokens is evicted first and the shared prefix survives longest. A released block
without a hash can never be hit, so it goes to the head and is reused before any cached one.

Prefix cache: `hash -> block`, a bijection with the blocks whose `block_hash` is set.
A block gets its hash when `commit` reports it full and computed, and loses it at eviction.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from spillway.protocol.messages import BlockHash


@dataclass(slots=True, eq=False)
class Block:
    block_id: int
    gpu_slot: int
    cpu_slot: int | None = None  # for the CPU tier; unused so far
    ref_count: int = 0
    block_hash: BlockHash | None = None
    # Links of the free list; both None exactly when the block is not in it.
    prev_free: Block | None = field(default=None, repr=False)
    next_free: Block | None = field(default=None, repr=False)


class FreeBlockList:
    """Intrusive doubly-linked list of free blocks with O(1) append, pop and removal."""

    def __init__(self, blocks: Sequence[Block]) -> None:
        self._head = Block(block_id=-1, gpu_slot=-1)  # sentinels: no None checks when linking
        self._tail = Block(block_id=-1, gpu_slot=-1)
        self._head.next_free, self._tail.prev_free = self._tail, self._head
        self._len = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Block]:
        block = self._head.next_free
        while block is not self._tail:
            yield block
            block = block.next_free

    def append(self, block: Block) -> None:
        self._link(block, self._tail.prev_free, self._tail)

    def appendleft(self, block: Block) -> None:
        self._link(block, self._head, self._head.next_free)

    def popleft(self) -> Block:
        if self._len == 0:
            raise IndexError("no free block")
        block = self._head.next_free
        self.remove(block)
        return block

    def remove(self, block: Block) -> None:
        if block.prev_free is None:
            raise ValueError(f"block {block.block_id} is not in the free list")
        block.prev_free.next_free, block.next_free.prev_free = block.next_free, block.prev_free
        block.prev_free = block.next_free = None
        self._len -= 1

    def _link(self, block: Block, before: Block, after: Block) -> None:
        if block.prev_free is not None:
            raise ValueError(f"block {block.block_id} is already in the free list")
        block.prev_free, block.next_free = before, after
        before.next_free = after.prev_free = block
        self._len += 1


@dataclass(slots=True)
class _BlockTable:
    block_ids: list[int]
    # Leading blocks already reported full by `commit` (or taken as cache hits).
    num_committed: int = 0


class BlockManager:
    """GPU blocks of `block_size` tokens and the prefix cache over them (see module doc).

    API: `find_cached_prefix` (lookup, no refs) -> `can_allocate` / `allocate` (refs on the
    hits, new blocks from the LRU head) -> `commit` (register hashes of full computed
    blocks) -> `free` (release tail-first). A request's block table covers its tokens in
    order: token t lives in block `block_table(request_id)[t // block_size]`.
    """

    def __init__(self, num_gpu_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_gpu_blocks <= 0 or block_size <= 0:
            raise ValueError(f"need blocks and a block size, got {num_gpu_blocks}, {block_size}")
        self.num_gpu_blocks = num_gpu_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(block_id=i, gpu_slot=i) for i in range(num_gpu_blocks)]
        self._free = FreeBlockList(self.blocks)
        self._cached: dict[BlockHash, Block] = {}
        self._tables: dict[str, _BlockTable] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks without references, cached or not: all of them can be allocated."""
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by requests."""
        return 1.0 - len(self._free) / self.num_gpu_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def free_block_ids(self) -> list[int]:
        """The free list in eviction order, head (next to be reused) first."""
        return [block.block_id for block in self._free]

    def block_table(self, request_id: str) -> list[int]:
        """A copy of the request's block ids ([] when it holds none)."""
        table = self._tables.get(request_id)
        return list(table.block_ids) if table else []

    def find_cached_prefix(self, block_hashes: Sequence[BlockHash]) -> list[int]:
        """Block ids of the longest prefix of `block_hashes` in the cache; takes no refs.

        The ids stay valid until the next `allocate` of another request may evict them.
        """
        hits: list[int] = []
        if not self.enable_prefix_caching:
            return hits
        for block_hash in block_hashes:
            block = self._cached.get(block_hash)
            if block is None:
                break
            hits.append(block.block_id)
        return hits

    def can_allocate(
        self, request_id: str, num_tokens: int, cached_blocks: Sequence[int] = ()
    ) -> bool:
        return self._num_free_blocks_taken(request_id, num_tokens, cached_blocks) <= len(self._free)

    def allocate(
        self, request_id: str, num_tokens: int, cached_blocks: Sequence[int] = ()
    ) -> bool:
        """Make the request's table cover `num_tokens` tokens; all or nothing.

        On the request's first allocation `cached_blocks` (from `find_cached_prefix`) become
        the head of its table, with a reference each; then new blocks are popped from the LRU
        head, dropping the hashes they held. Returns False, changing nothing, when there are
        not enough free blocks.
        """
        if not self.can_allocate(request_id, num_tokens, cached_blocks):
            return False
        table = self._tables.get(request_id)
        if table is None:
            table = self._tables[request_id] = _BlockTable(list(cached_blocks), len(cached_blocks))
            for block_id in cached_blocks:
                self._take_cached(self.blocks[block_id])
        for _ in range(self._num_blocks_needed(num_tokens) - len(table.block_ids)):
            block = self._free.popleft()
            self._evict(block)
            block.ref_count = 1
            table.block_ids.append(block.block_id)
        return True

    def commit(self, request_id: str, block_hashes: Sequence[BlockHash]) -> None:
        """The request's first len(block_hashes) blocks are full and computed: cache them.

        A hash already cached in another block keeps that mapping; this request keeps its own
        block, which stays unhashed. Blocks committed before are skipped, so each call costs
        only the newly full blocks.
        """
        table = self._tables[request_id]
        if len(block_hashes) > len(table.block_ids):
            raise ValueError(
                f"{request_id}: {len(block_hashes)} hashes for {len(table.block_ids)} blocks"
            )
        if self.enable_prefix_caching:
            for i in range(table.num_committed, len(block_hashes)):
                block = self.blocks[table.block_ids[i]]
                if block.block_hash is None and block_hashes[i] not in self._cached:
                    block.block_hash = block_hashes[i]
                    self._cached[block.block_hash] = block
        table.num_committed = max(table.num_committed, len(block_hashes))

    def free(self, request_id: str) -> None:
        """Release the request's blocks, last block first. No-op when it holds none."""
        table = self._tables.pop(request_id, None)
        if table is None:
            return
        for block_id in reversed(table.block_ids):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.block_hash is None:
                    self._free.appendleft(block)
                else:
                    self._free.append(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Refused (False, nothing changed) while blocks are in use."""
        if len(self._free) != self.num_gpu_blocks:
            return False
        for block in self._cached.values():
            block.block_hash = None
        self._cached.clear()
        return True

    def check_invariants(self) -> None:
        """Raise AssertionError on the first broken invariant (see the module doc)."""
        free_ids = [block.block_id for block in self._free]
        _check(len(free_ids) == len(self._free), "free list length differs from its count")
        _check(len(set(free_ids)) == len(free_ids), "a block is in the free list twice")
        tables = self._tables.values()
        refs = Counter(block_id for table in tables for block_id in table.block_ids)
        for block in self.blocks:
            name = f"block {block.block_id} (ref_count {block.ref_count})"
            _check(block.ref_count == refs[block.block_id], f"{name}: in {refs[block.block_id]} tables")
            _check((block.ref_count == 0) == (block.prev_free is not None),
                   f"{name}: free-list membership disagrees")
            if block.block_hash is not None:
                _check(self._cached.get(block.block_hash) is block, f"{name}: hash does not map to it")
        num_referenced = sum(block.ref_count > 0 for block in self.blocks)
        _check(num_referenced + len(free_ids) == self.num_gpu_blocks, "referenced + free != total")
        for block_hash, block in self._cached.items():
            _check(block.block_hash == block_hash, f"a hash maps to block {block.block_id} without it")
        _check(self.enable_prefix_caching or not self._cached, "hashes cached with caching off")
        gpu_slots = [block.gpu_slot for block in self.blocks]
        cpu_slots = [block.cpu_slot for block in self.blocks if block.cpu_slot is not None]
        _check(len(set(gpu_slots)) == len(gpu_slots), "a GPU slot is owned twice")
        _check(len(set(cpu_slots)) == len(cpu_slots), "a CPU slot is owned twice")
        for request_id, table in self._tables.items():
            ids, num_committed = table.block_ids, table.num_committed
            _check(len(set(ids)) == len(ids), f"{request_id}: a block appears twice in its table")
            _check(num_committed <= len(ids), f"{request_id}: more blocks committed than held")
            _check(all(self.blocks[i].block_hash is None for i in ids[num_committed:]),
                   f"{request_id}: an uncommitted block holds a hash")

    def _num_blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _num_free_blocks_taken(
        self, request_id: str, num_tokens: int, cached_blocks: Sequence[int]
    ) -> int:
        table = self._tables.get(request_id)
        if table is not None and cached_blocks:
            raise ValueError(f"{request_id}: cached blocks are taken on the first allocation only")
        if len(cached_blocks) * self.block_size > num_tokens:
            raise ValueError(f"{request_id}: {len(cached_blocks)} cached blocks, {num_tokens} tokens")
        if any(self.blocks[i].block_hash is None for i in cached_blocks):
            raise ValueError(f"{request_id}: a cached prefix block was evicted since the lookup")
        num_held = len(table.block_ids) if table else len(cached_blocks)
        num_new = max(0, self._num_blocks_needed(num_tokens) - num_held)
        # A hit on a free block takes it out of the free list too.
        return num_new + sum(self.blocks[i].ref_count == 0 for i in cached_blocks)

    def _take_cached(self, block: Block) -> None:
        if block.ref_count == 0:
            self._free.remove(block)
        block.ref_count += 1

    def _evict(self, block: Block) -> None:
        if block.block_hash is not None:
            del self._cached[block.block_hash]
            block.block_hash = None


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)
