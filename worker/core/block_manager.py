"""KV blocks, reference counts, GPU slots and the prefix cache: pure bookkeeping over integers.

A logical block (`Block`, see block_lru.py) carries a request's tokens and, once full and
computed, a prefix-cache entry. Its KV lives in a slot: a row of the GPU KV pool (`gpu_slot`)
or of the CPU pool (`cpu_slot`, for the CPU tier); either may be empty. Block ids are
bookkeeping only: the runner sees slot tables (`slot_table`), never block ids.

Every logical block is in exactly one state:

    referenced  ref_count > 0   in the tables of ref_count requests; owns a GPU slot
    cached      ref_count == 0  holds a hash and owns a GPU slot; in the LRU list, where a
                                lookup can hit it until its slot is taken (eviction)
    free        ref_count == 0  no hash, no slot; in the pool of free blocks

and every GPU slot is owned by one referenced or cached block, or is in the pool of free
slots. Free slots and cached blocks can all be allocated: `num_free_blocks` counts both,
in the order they are handed out (`free_gpu_slots`):

    free slots, last freed first   LRU of cached blocks, head (evicted next) ... tail
     [9]  [4]                  ->  [2] h(a,b) <-> [7] h(a) <-> [6] h(c)

A new block takes a free slot first, else the slot of the LRU head, whose hash is dropped
(lazy eviction). A released request's hashed blocks enter the LRU tail-first (last block
first), so among them the block covering the most tokens is evicted first and the shared
prefix survives longest. A released block without a hash can never be hit: it is freed at
once and its slot is reused before any cached one.

Prefix cache: `hash -> block`, a bijection with the blocks whose `block_hash` is set.
A block gets its hash when `commit` reports it full and computed, or when `adopt` takes it in
cached from another worker (disaggregated prefill), and loses it at eviction.
With `kv_events`, those two moments (and `reset_prefix_cache`) are recorded for the gateway
(worker/core/kv_events.py, `take_kv_events`); without, nothing is.

The CPU tier (worker/core/cpu_slots.py, with `num_cpu_blocks`; without one the null tier of
worker/core/tier.py, whose verbs do nothing) builds on the split of blocks from slots:
write-back gives a cached block a CPU slot before `_take_gpu_slot` drops its GPU slot (the
block then lives on the CPU only, keeping its id and hash: "cached on the CPU"), and a hit on
it takes a GPU slot through `_take_gpu_slot` and plans a load. The copies of a step are taken
with `take_copies` once the step is planned; a request with a block still loading
(`awaited_load_batch`) computes once the device reports that batch landed (`loads_landed`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from spillway.protocol.messages import BlockHash, KvEvents
from spillway.worker.core.block_invariants import check_invariants
from spillway.worker.core.block_lru import Block, BlockLRU, BlockTable
from spillway.worker.core.cpu_slots import CpuTier
from spillway.worker.core.kv_events import KvEventLog
from spillway.worker.core.prefix_lookup import CachedPrefix, current_prefix, look_up
from spillway.worker.core.readable_prefix import ReadablePrefix, readable_prefix
from spillway.worker.core.step_plan import KVCopies
from spillway.worker.core.tier import KVTier, NullTier


class BlockManager:
    """GPU slots of `block_size` tokens, the blocks in them and the prefix cache (module doc).

    API: `look_up` (no refs) -> `can_allocate` / `allocate` (refs on the
    hits, new blocks in free or evicted slots) -> `commit` (register hashes of full computed
    blocks) -> `free` (release tail-first). A request's slot table covers its tokens in
    order: token t lives in GPU slot `slot_table(request_id)[t // block_size]`. Between
    workers: `readable_prefix` (a producer's blocks to send, from either tier) and `adopt` (a
    consumer's blocks received, taken in cached).
    """

    def __init__(self, num_gpu_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 num_cpu_blocks: int = 0, kv_events: bool = False):
        if num_gpu_blocks <= 0 or block_size <= 0 or num_cpu_blocks < 0:
            raise ValueError(f"need blocks and a block size, got {num_gpu_blocks}, {block_size}, {num_cpu_blocks}")
        if num_cpu_blocks and not enable_prefix_caching:
            # The tier keeps prefix-cache entries: without hashes it could never be hit.
            raise ValueError("the CPU KV tier needs prefix caching; turn it on or give the tier no memory")
        self.num_gpu_blocks = num_gpu_blocks
        self.num_cpu_blocks = num_cpu_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # A block that is not free owns a GPU slot, a CPU slot or both: one block per slot.
        num_blocks = num_gpu_blocks + num_cpu_blocks
        self.blocks = [Block(block_id=i) for i in range(num_blocks)]
        self._free_block_ids = list(range(num_blocks - 1, -1, -1))  # a stack: pops 0 first
        self.tier: KVTier = CpuTier(num_cpu_blocks, self._drop_cpu_only) if num_cpu_blocks else NullTier()
        self._free_slots = deque(range(num_gpu_blocks))
        self._lru = BlockLRU()
        self._cached: dict[BlockHash, Block] = {}
        self._tables: dict[str, BlockTable] = {}
        self._version = 0  # counts allocations and releases: a `CachedPrefix` is valid between two
        self._events = KvEventLog() if kv_events else None  # None: the hashes' comings and goings go unrecorded

    @property
    def num_free_blocks(self) -> int:
        """GPU slots that can be allocated: free ones and those of cached blocks."""
        return len(self._free_slots) + len(self._lru)

    @property
    def usage(self) -> float:
        """Fraction of GPU slots held by referenced blocks."""
        return 1.0 - self.num_free_blocks / self.num_gpu_blocks

    @property
    def cpu_usage(self) -> float:
        """Fraction of CPU slots holding a copy (0 without a tier)."""
        return self.tier.usage

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def on_gpu(self, block_id: int) -> bool:
        """Whether the block's KV is in a GPU slot (a lookup hit on it needs no load)."""
        return self.blocks[block_id].gpu_slot is not None

    def awaited_load_batch(self, request_id: str) -> int:
        """The last load batch bringing one of the request's blocks from the CPU tier (planned
        in the copies not taken yet, or on its way); 0 when none is. Only hits load, and a
        referenced block is never loaded again: the batch is fixed when the hits are taken."""
        table = self._tables.get(request_id)
        if table is None or table.load_batch <= self.tier.landed_through:
            return 0
        return table.load_batch

    def take_copies(self) -> KVCopies:
        """The copies planned since the last call, for the step being planned (module doc)."""
        return self.tier.take_copies()

    def loads_landed(self, through: int | None = None) -> None:
        """The load batches up to `through` (every one taken so far when None) are on the GPU."""
        self.tier.complete_load(through)

    def wait_for_loads_this_step(self) -> None:
        """The step being planned computes requests whose loads may still be landing: its
        forward waits for every load queued (planned before the landing)."""
        self.tier.wait_for_loads_this_step()

    def write_back_ahead(self, max_blocks: int, max_scan: int) -> int:
        """CPU copies for up to `max_blocks` cached GPU blocks from the LRU head, looking at
        most `max_scan` deep (`CpuTier.prepare_store_ahead`); how many were planned. Into a
        full tier (replacing its oldest copies) only while fewer than `max_scan` GPU slots are
        free: the next allocations then reach that deep into the LRU."""
        return self.tier.prepare_store_ahead(self._lru, max_blocks, max_scan,
                                             replace=len(self._free_slots) < max_scan)

    def free_gpu_slots(self) -> list[int]:
        """The allocatable GPU slots in the order they are taken: free slots, then the slots
        of cached blocks from the LRU head."""
        return list(self._free_slots) + [block.gpu_slot for block in self._lru]

    def slot_table(self, request_id: str) -> list[int]:
        """A copy of the GPU slots of the request's blocks, in token order ([] when none)."""
        table = self._tables.get(request_id)
        return list(table.slots) if table else []

    def block_ids(self, request_id: str) -> list[int]:
        """The request's logical block ids, in token order ([] when none); for tests and debug."""
        table = self._tables.get(request_id)
        return [block.block_id for block in table.blocks] if table else []

    def look_up(self, block_hashes: Sequence[BlockHash], count: int | None = None) -> CachedPrefix:
        """The longest prefix of `block_hashes[:count]` in the cache, on the GPU or the CPU;
        takes no refs. Valid until the next allocation or release (`allocate` refuses it then)."""
        if not self.enable_prefix_caching:
            return CachedPrefix([], self._version)
        return look_up(self._cached, block_hashes, len(block_hashes) if count is None else count, self._version)

    def find_cached_prefix(self, block_hashes: Sequence[BlockHash]) -> list[int]:
        """Block ids (not slots) of the longest cached prefix of `block_hashes` (`look_up`)."""
        return self.look_up(block_hashes).block_ids

    def can_allocate(self, request_id: str, num_tokens: int,
                     cached_blocks: CachedPrefix | Sequence[int] = ()) -> bool:
        prefix = current_prefix(cached_blocks, self.blocks, self._version)
        return self._num_free_blocks_taken(request_id, num_tokens, prefix) <= self.num_free_blocks

    def allocate(self, request_id: str, num_tokens: int, cached_blocks: CachedPrefix | Sequence[int] = ()) -> bool:
        """Make the request's table cover `num_tokens` tokens; all or nothing.

        On the request's first allocation the hits `cached_blocks` (from `look_up`, or block
        ids from `find_cached_prefix`) become the head of its table, with a reference each
        (those cached on the CPU only get a GPU slot and a load); then new blocks get free
        slots, or the slots of evicted cached blocks. Returns False, changing nothing, when
        there are not enough allocatable slots.
        """
        table = self._tables.get(request_id)
        if table is not None and not cached_blocks and len(table.blocks) * self.block_size >= num_tokens:
            return True  # covered already: a decode step's usual case, 15 times in 16
        prefix = current_prefix(cached_blocks, self.blocks, self._version)
        if self._num_free_blocks_taken(request_id, num_tokens, prefix) > self.num_free_blocks:
            return False
        self._version += 1
        if table is None:
            hits = prefix.blocks
            # Every hit is held before any slot is taken: no eviction below can reach one (the
            # tier pins those on the CPU before it takes their GPU slots).
            on_cpu = []
            for block in hits:
                if block.gpu_slot is None:  # a GPU slot and a load below
                    block.ref_count = 1
                    on_cpu.append(block)
                elif block.ref_count:  # shared with a running request: the usual hit
                    block.ref_count += 1
                else:
                    self._take_cached(block)
            load_batch = prefix.load_batch
            if on_cpu:  # one load batch: this request's
                load_batch = self.tier.prepare_load(on_cpu, self._take_gpu_slot)
            table = self._tables[request_id] = BlockTable(list(hits), [block.gpu_slot for block in hits],
                                                          len(hits), load_batch)
        for _ in range(self._num_blocks_needed(num_tokens) - len(table.blocks)):
            block = self._new_block()
            table.blocks.append(block)
            table.slots.append(block.gpu_slot)
        return True

    def commit(self, request_id: str, block_hashes: Sequence[BlockHash]) -> None:
        """The request's first len(block_hashes) blocks are full and computed: cache them.

        A hash already cached in another block keeps that mapping; this request keeps its own
        block, which stays unhashed. Blocks committed before are skipped, so each call costs
        only the newly full blocks.
        """
        table = self._tables[request_id]
        if len(block_hashes) > len(table.blocks):
            raise ValueError(f"{request_id}: {len(block_hashes)} hashes for {len(table.blocks)} blocks")
        if self.enable_prefix_caching:
            events = self._events
            for i in range(table.num_committed, len(block_hashes)):
                block = table.blocks[i]
                if block.block_hash is None and block_hashes[i] not in self._cached:
                    block.block_hash = block_hashes[i]
                    self._cached[block.block_hash] = block
                    if events is not None:
                        events.stored(block.block_hash)
        table.num_committed = max(table.num_committed, len(block_hashes))

    def free(self, request_id: str) -> None:
        """Release the request's blocks, last block first. No-op when it holds none."""
        table = self._tables.pop(request_id, None)
        if table is None:
            return
        self._version += 1
        for block in reversed(table.blocks):
            block.ref_count -= 1
            if block.ref_count > 0:
                continue
            if block.block_hash is None:
                self._free_slots.appendleft(block.gpu_slot)
                self._free_block(block)
            else:
                self._lru.append(block)

    def adopt(self, block_hashes: Sequence[BlockHash]) -> list[tuple[BlockHash, int]]:
        """Take blocks that arrive from another worker (disaggregated prefill: worker/driver/kv_pulls.py)
        into the prefix cache: `block_hashes` in prompt order (a chain). Each one not cached yet
        gets a GPU slot as a new block would (a free slot, else the LRU head's, whose block is
        evicted; never a referenced block's, nor one adopted by this call) and is registered
        under its hash, cached and evictable; stops at the first that finds no slot. Returns
        the (hash, GPU slot) pairs taken, in order: the caller writes their KV into those slots
        before any step reads them.

        The adopted blocks enter the LRU's tail as a released request's do, last block first,
        so the deepest is evicted first. `num_free_blocks` is unchanged: a cached block's slot
        counts as free."""
        if not self.enable_prefix_caching:
            return []
        adopted: list[Block] = []
        cached = self._cached
        # The free slots and the LRU as they were on entry: an adopted block joins the LRU
        # only at the end, so no slot taken below is one of this call's.
        for block_hash in block_hashes:
            if block_hash in cached:
                continue  # held already (on the GPU or the CPU tier): its KV is the same
            if not self._free_slots and not self._lru:
                break
            slot = self._take_gpu_slot()
            block = self.blocks[self._free_block_ids.pop()]
            block.gpu_slot, block.block_hash = slot, block_hash
            cached[block_hash] = block
            if self._events is not None:
                self._events.stored(block_hash)
            adopted.append(block)
        if adopted:
            self._version += 1  # evictions above may have dropped a looked-up hit
            for block in reversed(adopted):
                self._lru.append(block)
        return [(block.block_hash, block.gpu_slot) for block in adopted]

    def readable_prefix(self, block_hashes: Sequence[BlockHash]) -> ReadablePrefix:
        """Where the KV of the longest prefix of `block_hashes` can be read now, to serve it to
        another worker (worker/core/readable_prefix.py): per block a GPU slot (cached there, no
        load planned or on its way into it), else a CPU-tier slot whose store has landed in host
        memory (`stores_landed`); stops at the first block with neither. Takes no refs: read
        the slots before the next step is planned."""
        return readable_prefix(self.look_up(block_hashes).blocks, self.tier)

    def stores_landed(self, through: int) -> None:
        """The CPU tier's store batches up to `through` (`KVCopies.store_batch`) are in host
        memory: their copies may be read (`readable_prefix`)."""
        self.tier.stores_landed(through)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Refused (False, nothing changed) while blocks are in use."""
        if self.num_free_blocks != self.num_gpu_blocks:
            return False
        self._version += 1
        gpu_cached = []
        while self._lru:
            gpu_cached.append(self._lru.popleft())
            self._free_slots.append(gpu_cached[-1].gpu_slot)  # behind the free slots: the order stays
        cpu_only = [block for block in self._cached.values() if block.gpu_slot is None]
        for block in gpu_cached + cpu_only:
            if block.cpu_slot is not None:
                self.tier.forget(block)
            block.block_hash = None
            self._free_block(block)
        self._cached.clear()
        if self._events is not None:
            self._events.cleared()
        return True

    def take_kv_events(self) -> KvEvents | None:
        """The changes to the hashes held since the last call; None when there are none or
        when the manager records none (`kv_events` off)."""
        return None if self._events is None else self._events.take()

    def kv_events_snapshot(self) -> KvEvents:
        """Every hash held, in the order stored, as a report that replaces whatever a consumer
        held (`cleared`): for a gateway that attaches to a running worker. O(cached blocks)."""
        return KvEvents(stored=list(self._cached), removed=[], cleared=True)

    def held_block_hashes(self) -> set[BlockHash]:
        """The hashes a lookup can find, read from the blocks themselves (on either tier).
        O(blocks): for tests and debug mode, against a replay of the KV events."""
        return {block.block_hash for block in self.blocks if block.block_hash is not None}

    def check_invariants(self) -> None:
        """Raise AssertionError on the first broken invariant (module doc). O(blocks): for
        tests and debug mode only (worker/core/block_invariants.py)."""
        check_invariants(self.blocks, self._tables, lru=self._lru, free_block_ids=self._free_block_ids,
                         free_slots=self._free_slots, cached=self._cached, num_gpu_blocks=self.num_gpu_blocks,
                         num_cpu_blocks=self.num_cpu_blocks, enable_prefix_caching=self.enable_prefix_caching,
                         tier=self.tier)

    def _num_blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _num_free_blocks_taken(self, request_id: str, num_tokens: int, prefix: CachedPrefix) -> int:
        table = self._tables.get(request_id)
        if table is not None and prefix.blocks:
            raise ValueError(f"{request_id}: cached blocks are taken on the first allocation only")
        if len(prefix) * self.block_size > num_tokens:
            raise ValueError(f"{request_id}: {len(prefix)} cached blocks, {num_tokens} tokens")
        # A hit on a cached GPU block takes its slot out of the allocatable ones too; one on
        # the CPU takes a slot for its load.
        num_held = len(table.blocks) if table else len(prefix)
        return (max(0, self._num_blocks_needed(num_tokens) - num_held) + prefix.num_unreferenced
                + prefix.num_on_cpu)

    def _take_cached(self, block: Block) -> None:
        if block.ref_count == 0:
            self._lru.remove(block)
        block.ref_count += 1

    def _new_block(self) -> Block:
        slot = self._take_gpu_slot()  # first: an eviction returns a block to the pool
        block = self.blocks[self._free_block_ids.pop()]
        block.gpu_slot, block.ref_count = slot, 1
        return block

    def _take_gpu_slot(self) -> int:
        """A free GPU slot, else the slot of the LRU head, whose block is evicted: written
        back to the CPU tier first when it has no CPU copy (and the tier a slot for one)."""
        if self._free_slots:
            return self._free_slots.popleft()
        block = self._lru.popleft()
        slot, block.gpu_slot = block.gpu_slot, None
        self.tier.evicted(block)  # an ahead store or a load may still use the slot: its reuse waits
        if block.cpu_slot is None and not self.tier.prepare_store(block, slot):
            self._drop_cpu_only(block)
        return slot

    def _drop_cpu_only(self, block: Block) -> None:
        """A cached block without a GPU slot lost (or never got) its CPU copy: forget it."""
        self._version += 1  # a lookup may hold it (write-back ahead drops outside `allocate`)
        del self._cached[block.block_hash]
        if self._events is not None:
            self._events.removed(block.block_hash)
        block.block_hash = None
        self._free_block(block)

    def _free_block(self, block: Block) -> None:
        """Back to the pool: the block has no references and its slots went elsewhere."""
        block.gpu_slot = None
        self._free_block_ids.append(block.block_id)
