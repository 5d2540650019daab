"""The CPU tier's bookkeeping: CPU slots, their LRU and the copies a step plans between tiers.

The tier behind the verbs of worker/core/tier.py. A block gets a CPU slot in one way:
write-back, when the block manager evicts a cached GPU block that has no CPU copy yet
(`prepare_store`). The CPU copy then serves lookups after the GPU slot went elsewhere; a hit on
it gives the block a new GPU slot and plans a load (`prepare_load`).

Within one step's plan, every CPU slot that a copy reads or writes is pinned (out of the
CPU LRU, so never evicted and never reused) until `take_copies` hands the copies to the
plan. That makes the step's copies order-free but for one rule: a load runs after the stores
when it fills a GPU slot that a store reads (the slot of a block evicted in the same step;
worker/kv_tier/copier.py), while a CPU slot is never both a load's source and a store's
destination in one step. `prepare_load` pins the CPU copies a lookup hit before it takes any
GPU slot for them, so no eviction between lookup and load can drop them.

Every CPU copy belongs to a hashed block: a block with a CPU copy and no GPU slot is cached
on the CPU only; evicting its CPU copy then frees the block (`drop` callback).

Write-back ahead (`prepare_store_ahead`): cached GPU blocks near the head of the GPU LRU get a CPU
copy before they are evicted, so that the eviction that later takes their slot has no store to
wait for: a load into that slot (a CPU hit) then runs alone instead of behind a store of the
same size. They take free CPU slots, and once none is free (a long-running tier is full) the
slots of the least recently used copies of blocks on the CPU only, as the store at their
eviction would: the copies dropped are the same, a little sooner. A copy whose block is on the
GPU too is never replaced ahead (two blocks written back ahead would take each other's slot
in turn); passed over, it goes to the LRU's tail. Only the GPU LRU's head is written back
ahead, and into a full tier only while the GPU's free slots would not last through that
head's depth (the caller says, `replace`), so a GPU with room to spare costs the tier no copy. Those
copies run on the store stream without holding up any forward; a step that evicts a block
whose ahead store may still run (`evicted`) makes its forward and its loads wait for it,
until the device says they have finished (`complete_store`).

Reading a CPU copy on the host (a producer serving it to another worker, worker/driver/engine.py
`serve_kv_pull`) needs its bytes in host memory, which a block's `cpu_slot` alone does not say.
The slot is set when a store is planned (`prepare_store`, `prepare_store_ahead`), the store runs
once the step's copies are taken and run, and on CUDA it lands later, asynchronously, on the
store stream. So each `take_copies` numbers its stores, of both kinds, as one store batch
(`KVCopies.store_batch`), every CPU slot remembers the batch that last wrote it, and the engine
reports the batches the device has finished (`stores_landed`). The invariant `readable_copy`
rests on:

    a CPU slot holds its block's KV in host memory  <=>  the block owns it, and the batch that
                                                          last wrote it is <= `stored_through`

Stores are the only writes into the pool (loads read it), and they run on one stream in the
order their batches were taken, so a landed batch has every store before it landed too. A slot
is written again only after the tier gives it to another block (a store planned into a free
slot, or the CPU LRU head's, whose block loses it): that later plan marks it with a later
batch, not landed yet. A block loading back into the GPU keeps its CPU copy (held until the
load lands; loads never write it), so its bytes may be read from the CPU meanwhile.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence

from spillway.protocol.messages import BlockHash
from spillway.worker.core.block_lru import Block
from spillway.worker.core.step_plan import NO_KV_COPIES, KVCopies


class CpuTier:
    """CPU slots of one block each, an LRU of the evictable CPU copies and this step's copies
    (a `KVTier`, worker/core/tier.py)."""

    def __init__(self, num_blocks: int, drop: Callable[[Block], None]) -> None:
        if num_blocks <= 0:
            raise ValueError(f"a CPU tier needs blocks, got {num_blocks}")
        self.num_blocks = num_blocks
        self._drop = drop  # a CPU-only block lost its last copy: forget its hash, free it
        self._free_slots = deque(range(num_blocks))
        # block id -> block, head evicted next; holds exactly the unpinned CPU copies.
        self._lru: OrderedDict[int, Block] = OrderedDict()
        self._pinned: dict[int, Block] = {}  # by block id: CPU copies this step's copies touch
        # By block id: CPU copies a load taken with an earlier step's copies may still read,
        # out of the LRU until it lands, so that no store overwrites them meanwhile.
        self._held: dict[int, Block] = {}
        # By block id: the blocks whose load is in this step's copies or in copies taken whose
        # loads have not landed yet (`complete_load` drops those); each block's `load_batch` says which
        # batch (`KVCopies.load_batch_ends`): their requests compute once it has landed.
        self._loading: dict[int, Block] = {}
        self.landed_through = 0  # every load batch up to this one has landed
        self._num_load_batches = 0  # load batches numbered so far
        self._taken_through = 0  # the last batch taken with a step's copies
        self._batch_ids: deque[tuple[int, list[int]]] = deque()  # taken batches not landed, in order
        self._step_batches: list[tuple[int, list[int], int]] = []  # not taken yet: (batch, ids, end)
        self._wait_for_loads = False
        self._wait_by_layer = False  # the step was planned before the landing (KVCopies.wait_by_layer)
        self._stores: list[tuple[int, int]] = []
        self._loads: list[tuple[int, int]] = []
        self._ahead: list[tuple[int, int]] = []  # this step's write-back ahead of eviction
        self._ahead_ids: list[int] = []  # and the ids of its blocks
        # Block ids of ahead stores taken whose completion the device has not confirmed
        # (`complete_store` clears them), and whether this step evicts one of them.
        self._ahead_pending: set[int] = set()
        self._wait_for_ahead = False
        # What each owned CPU slot holds: the hash of the block stored there (invariants).
        self.slot_hashes: dict[int, BlockHash] = {}
        # Store batches (`KVCopies.store_batch`): numbered so far, and every one up to
        # `stored_through` written into host memory; per CPU slot, the batch that last wrote it
        # (the next one while its store is planned and not taken).
        self._num_store_batches = 0
        self.stored_through = 0
        self._slot_store_batch = [0] * num_blocks
        # Cumulative counts of blocks copied each way.
        self.num_stored = 0
        self.num_loaded = 0

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free_slots)

    @property
    def usage(self) -> float:
        """Fraction of CPU slots holding a copy."""
        return self.num_used / self.num_blocks

    def prepare_store(self, block: Block, gpu_slot: int) -> bool:
        """Give the hashed `block` a CPU copy of its GPU slot's KV (write-back): a free CPU
        slot, else the one of the least recently used CPU copy. False when every CPU slot is
        pinned by this step's copies (the block is then simply evicted)."""
        assert block.block_hash is not None and block.cpu_slot is None
        slot = self._take_slot()
        if slot is None:
            return False
        block.cpu_slot = slot
        self.slot_hashes[slot] = block.block_hash
        self._slot_store_batch[slot] = self._num_store_batches + 1
        self._pinned[block.block_id] = block
        self._stores.append((gpu_slot, slot))
        self.num_stored += 1
        return True

    @property
    def num_free(self) -> int:
        return len(self._free_slots)

    @property
    def num_ahead_pending(self) -> int:
        """Blocks whose ahead store was taken with a step's copies and may still run."""
        return len(self._ahead_pending)

    def prepare_store_ahead(self, gpu_lru: Iterable[Block], max_blocks: int, max_scan: int,
                            replace: bool = False) -> int:
        """Plan CPU copies of up to `max_blocks` cached GPU blocks without one, in `gpu_lru`'s
        order (the next evicted first), looking at most `max_scan` deep; into free CPU slots,
        and with `replace` into those of the least recently used CPU-only copies too (module
        doc); only once the ahead stores taken before have finished (one batch on the copy
        stream at a time). Returns how many."""
        room = len(self._free_slots) + (len(self._lru) if replace else 0)
        if self._ahead_pending or not room:
            return 0
        chosen = []
        wanted = min(max_blocks, room)
        for depth, block in enumerate(gpu_lru):
            if len(chosen) == wanted or depth == max_scan:
                break
            if block.cpu_slot is None:
                chosen.append(block)
        slots, moves = [], min(max_scan, len(self._lru))
        for _ in chosen:
            slot = self._free_slots.popleft() if self._free_slots else None
            if slot is None and replace:
                slot, moves = self._cold_slot(moves)
            if slot is None:
                break
            slots.append(slot)
        # The next evicted keep their place; ascending GPU slots take the slots in order: where
        # both are consecutive, the stores copy as one run (`kv_copies.block_runs`).
        for block, slot in zip(sorted(chosen[:len(slots)], key=lambda block: block.gpu_slot), slots):
            block.cpu_slot = slot
            self.slot_hashes[slot] = block.block_hash
            self._slot_store_batch[slot] = self._num_store_batches + 1
            self._pinned[block.block_id] = block
            self._ahead.append((block.gpu_slot, slot))
            self._ahead_ids.append(block.block_id)
        self.num_stored += len(slots)
        return len(slots)

    def _cold_slot(self, moves: int) -> tuple[int | None, int]:
        """The slot of the least recently used CPU copy of a block on the CPU only, and the
        moves left: a copy whose block is on the GPU too goes to the LRU's tail instead (the
        block is in use, and replacing it would only make it the next one written back), at
        most `moves` of them."""
        while self._lru:
            block_id, victim = next(iter(self._lru.items()))
            if victim.gpu_slot is None:
                return self._take_slot(), moves
            if not moves:
                break
            self._lru.move_to_end(block_id)
            moves -= 1
        return None, moves

    def evicted(self, block: Block) -> None:
        """The block's GPU slot goes to another block this step: if its ahead store may still
        be reading that slot, the step waits for the ahead stores; if its load may still be
        writing it (its request went before the load landed), for the loads."""
        if block.block_id in self._ahead_pending:
            self._wait_for_ahead = True
        if block.block_id in self._loading:
            self._wait_for_loads = True

    def wait_for_loads_this_step(self) -> None:
        """This step computes requests whose loads may still be landing: its forward waits for
        every load queued, layer by layer (planned before the landing, worker/driver/tier_driver.py)."""
        self._wait_for_loads = self._wait_by_layer = True

    def complete_store(self) -> None:
        """Every ahead store taken so far has finished on the device."""
        self._ahead_pending.clear()

    def stores_landed(self, through: int) -> None:
        """The store batches up to `through` have finished writing host memory (module doc)."""
        assert through <= self._num_store_batches, f"store batch {through} of {self._num_store_batches} taken"
        self.stored_through = max(self.stored_through, through)

    def readable_copy(self, block: Block) -> int | None:
        """The CPU slot whose host memory holds the block's KV now, or None: no CPU copy, or its
        store is planned, or taken and not known to have landed (module doc). Valid until the
        next plan gives the slot to another block: read it before then."""
        slot = block.cpu_slot
        if slot is None or self._slot_store_batch[slot] > self.stored_through:
            return None
        return slot

    def prepare_load(self, blocks: Sequence[Block], take_gpu_slot: Callable[[], int]) -> int:
        """Plan the loads of one request's CPU hits `blocks`: pin their CPU copies first, so
        that no eviction by `take_gpu_slot` (which may store into the slot of the least recently
        used copy) can reach one, then take a GPU slot for each and set its `gpu_slot`. One
        batch, which lands, and lets its request compute, without waiting for the batches
        planned after it; returns the batch's number. Ascending CPU slots get ascending GPU
        slots: where both are consecutive the loads copy as one run (`kv_copies.block_runs`),
        not a copy per block."""
        for block in blocks:
            self._pin(block)
        gpu_slots = [take_gpu_slot() for _ in blocks]
        batch = self._num_load_batches = self._num_load_batches + 1
        block_ids = []
        for block, gpu_slot in zip(sorted(blocks, key=lambda block: block.cpu_slot), sorted(gpu_slots)):
            assert block.block_id in self._pinned and block.cpu_slot is not None
            block.gpu_slot, block.load_batch = gpu_slot, batch
            self._loads.append((block.cpu_slot, gpu_slot))
            self._loading[block.block_id] = block
            block_ids.append(block.block_id)
        self.num_loaded += len(block_ids)
        self._step_batches.append((batch, block_ids, len(self._loads)))
        return batch

    def _pin(self, block: Block) -> None:
        """Keep the block's CPU copy until this step's copies are taken."""
        if self._lru.pop(block.block_id, None) is not None or block.block_id in self._held:
            self._pinned[block.block_id] = block

    @property
    def num_loading(self) -> int:
        """Blocks whose load is planned or on its way."""
        return len(self._loading)

    def complete_load(self, through: int | None = None) -> None:
        """The load batches up to `through` (every batch taken so far when None) have landed
        on the GPU (one stream: they land in order)."""
        if through is None:
            through = self._taken_through
        self.landed_through = max(self.landed_through, through)
        while self._batch_ids and self._batch_ids[0][0] <= through:
            batch, block_ids = self._batch_ids.popleft()
            for block_id in block_ids:
                block = self._loading.get(block_id)
                if block is None or block.load_batch != batch:
                    continue  # loaded again since: held until that load lands
                del self._loading[block_id]
                block.load_batch = 0
                block = self._held.pop(block_id, None)
                if block is not None and block_id not in self._pinned:
                    self._lru[block_id] = block

    def take_copies(self) -> KVCopies:
        """This step's copies, in plan order per direction; unpins their CPU copies."""
        for block in self._pinned.values():
            if block.block_id in self._loading:  # a load reads it: held until that lands
                self._held[block.block_id] = block
            else:
                self._held.pop(block.block_id, None)
                self._lru[block.block_id] = block
        self._pinned.clear()
        if not (self._stores or self._loads or self._ahead or self._wait_for_ahead or self._wait_for_loads):
            return NO_KV_COPIES
        for batch, block_ids, _ in self._step_batches:
            self._batch_ids.append((batch, block_ids))
        ends = tuple((batch, end) for batch, _, end in self._step_batches)
        self._step_batches = []
        if ends:
            self._taken_through = ends[-1][0]
        store_batch = 0
        if self._stores or self._ahead:  # the slots they write are marked with this number already
            store_batch = self._num_store_batches = self._num_store_batches + 1
        copies = KVCopies(gpu_to_cpu=tuple(self._stores), cpu_to_gpu=tuple(self._loads),
                          ahead_to_cpu=tuple(self._ahead), wait_for_ahead=self._wait_for_ahead,
                          load_batch=ends[-1][0] if ends else 0, load_batch_ends=ends,
                          wait_for_loads=self._wait_for_loads, wait_by_layer=self._wait_by_layer,
                          store_batch=store_batch)
        if self._wait_for_ahead:
            self._ahead_pending.clear()  # this step waits for all of them
        self._ahead_pending.update(self._ahead_ids)
        self._stores.clear()
        self._loads.clear()
        self._ahead.clear()
        self._ahead_ids.clear()
        self._wait_for_ahead = self._wait_for_loads = self._wait_by_layer = False
        return copies

    def forget(self, block: Block) -> None:
        """Drop the block's CPU copy (the caller deals with the block)."""
        self._lru.pop(block.block_id, None)
        self._pinned.pop(block.block_id, None)
        self._held.pop(block.block_id, None)
        self._release_slot(block)

    def _take_slot(self) -> int | None:
        if self._free_slots:
            return self._free_slots.popleft()
        if not self._lru:
            return None
        _, victim = self._lru.popitem(last=False)
        slot = victim.cpu_slot
        self.slot_hashes.pop(slot)
        victim.cpu_slot = None
        if victim.gpu_slot is None:
            self._drop(victim)
        return slot

    def _release_slot(self, block: Block) -> None:
        self.slot_hashes.pop(block.cpu_slot)
        self._free_slots.append(block.cpu_slot)
        block.cpu_slot = None

    def check_invariants(self, blocks: list[Block], check: Callable[[bool, str], None]) -> None:
        """The CPU side of BlockManager.check_invariants."""
        owners = {block.cpu_slot: block for block in blocks if block.cpu_slot is not None}
        free = list(self._free_slots)
        check(len(set(free)) == len(free), "a CPU slot is free twice")
        check(not set(free) & set(owners), "a CPU slot is owned and free")
        check(len(owners) + len(free) == self.num_blocks, "CPU slots lost")
        check(set(self.slot_hashes) == set(owners), "CPU slot contents disagree with their owners")
        check(not set(self._lru) & set(self._pinned), "a CPU copy is both pinned and in the CPU LRU")
        check(not set(self._lru) & set(self._held), "a CPU copy is both held for a load and in the CPU LRU")
        check(set(self._held) <= set(self._loading), "a CPU copy is held for a load that landed")
        check(self.stored_through <= self._num_store_batches, "a store batch landed before it was taken")
        check(max(self._slot_store_batch) <= self._num_store_batches + 1, "a CPU slot written by a batch not planned")
        check({block.block_id for block in blocks if block.load_batch} == set(self._loading),
              "a block's load batch disagrees with the loads on their way")
        for slot, block in owners.items():
            name = f"block {block.block_id} (CPU slot {slot})"
            check(block.block_hash is not None, f"{name}: a CPU copy without a hash")
            check(self.slot_hashes[slot] == block.block_hash, f"{name}: its CPU copy holds another block's KV")
            listed = (self._lru.get(block.block_id) or self._pinned.get(block.block_id)
                      or self._held.get(block.block_id))
            check(listed is block, f"{name}: neither in the CPU LRU nor pinned nor held for a load")
        listed = set(self._lru) | set(self._pinned) | set(self._held)
        check(len(listed) == len(owners), "the CPU LRU lists a block without a CPU copy")
