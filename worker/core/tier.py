"""The verbs between the block manager and a lower KV tier, and the tier that holds nothing.

The block manager keeps one prefix cache over both tiers (`hash -> block`): a block whose KV
lives only in the lower tier keeps its id and hash, so a lookup finds it with the GPU ones and
says how many hits need a load (`CachedPrefix.num_on_cpu`). What the tier decides is where its
copies go and when they may be reused, through verbs in the spirit of vLLM's OffloadingManager:

    prepare_load  -> take_copies -> (the device lands it) -> complete_load
    prepare_store -> take_copies -> (the step's forward waits for it)
    prepare_store_ahead -> take_copies -> (the device finishes it) -> complete_store
    (any store) -> take_copies -> (the device writes it into host memory) -> stores_landed
                -> readable_copy (a producer reads the CPU copy on the host)

`CpuTier` (worker/core/cpu_slots.py) is the tier of `num_cpu_blocks` host slots; `NullTier`
is the tier of a worker without one: it stores nothing, so nothing is ever loaded from it, and
its copies are always `NO_KV_COPIES`. The block manager and the scheduler call the same verbs
either way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Protocol, runtime_checkable

from spillway.worker.core.block_lru import Block
from spillway.worker.core.step_plan import NO_KV_COPIES, KVCopies


@runtime_checkable
class KVTier(Protocol):
    """A lower tier of KV blocks below the GPU pool, as the block manager drives it."""

    num_blocks: int
    landed_through: int  # every load batch up to this one has landed
    stored_through: int  # every store batch up to this one is in host memory

    @property
    def usage(self) -> float:
        """Fraction of the tier's slots holding a copy."""

    @property
    def num_loading(self) -> int:
        """Blocks whose load is planned or on its way."""

    @property
    def num_ahead_pending(self) -> int:
        """Blocks whose store ahead of eviction was taken with a step's copies and may still run."""

    def prepare_load(self, blocks: Sequence[Block], take_gpu_slot: Callable[[], int]) -> int:
        """Hold the (CPU-only) hit `blocks` against eviction, then give each a GPU slot from
        `take_gpu_slot` and plan its load: one batch; returns its number."""

    def complete_load(self, through: int | None = None) -> None:
        """The load batches up to `through` (every one taken when None) have landed."""

    def wait_for_loads_this_step(self) -> None:
        """This step computes requests whose loads may still be landing: its forward waits."""

    def prepare_store(self, block: Block, gpu_slot: int) -> bool:
        """Write the evicted cached `block` back from `gpu_slot`; False when it cannot (the
        block is then dropped from the cache)."""

    def prepare_store_ahead(self, gpu_lru: Iterable[Block], max_blocks: int, max_scan: int,
                            replace: bool = False) -> int:
        """Write back up to `max_blocks` cached GPU blocks ahead of their eviction; how many."""

    def complete_store(self) -> None:
        """Every store ahead of eviction taken so far has finished on the device."""

    def stores_landed(self, through: int) -> None:
        """The store batches (`KVCopies.store_batch`) up to `through` are in host memory."""

    def readable_copy(self, block: Block) -> int | None:
        """The slot of the block's copy in the tier when its bytes may be read on the host now;
        None when it has none, or its store has not landed."""

    def evicted(self, block: Block) -> None:
        """The block's GPU slot goes to another block this step."""

    def take_copies(self) -> KVCopies:
        """The copies planned since the last call, for the step being planned."""

    def forget(self, block: Block) -> None:
        """Drop the block's copy in the tier (the caller deals with the block)."""

    def check_invariants(self, blocks: list[Block], check: Callable[[bool, str], None]) -> None:
        """The tier's side of `BlockManager.check_invariants`."""


class NullTier:
    """The tier of a worker without one: it holds nothing, so an evicted block is dropped
    (`prepare_store` refuses), no block is ever cached below the GPU, nothing loads and no
    step copies anything."""

    num_blocks = 0
    landed_through = 0
    stored_through = 0
    usage = 0.0
    num_loading = 0
    num_ahead_pending = 0

    def prepare_load(self, blocks: Sequence[Block], take_gpu_slot: Callable[[], int]) -> int:
        assert not blocks, "a load from the null tier: it holds no block"
        return 0

    def complete_load(self, through: int | None = None) -> None:
        pass

    def wait_for_loads_this_step(self) -> None:
        pass

    def prepare_store(self, block: Block, gpu_slot: int) -> bool:
        return False

    def prepare_store_ahead(self, gpu_lru: Iterable[Block], max_blocks: int, max_scan: int,
                            replace: bool = False) -> int:
        return 0

    def complete_store(self) -> None:
        pass

    def stores_landed(self, through: int) -> None:
        assert not through, "a store into the null tier: it holds no block"

    def readable_copy(self, block: Block) -> int | None:
        return None

    def evicted(self, block: Block) -> None:
        pass

    def take_copies(self) -> KVCopies:
        return NO_KV_COPIES

    def forget(self, block: Block) -> None:
        raise AssertionError(f"block {block.block_id}: the null tier holds no copy to forget")

    def check_invariants(self, blocks: list[Block], check: Callable[[bool, str], None]) -> None:
        for block in blocks:
            check(block.cpu_slot is None and not block.load_batch,
                  f"block {block.block_id}: a copy or a load in a worker without a CPU tier")
