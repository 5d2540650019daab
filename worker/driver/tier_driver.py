"""The engine's side of the CPU tier: what it asks the device before each step, what it writes
back while idle, and how it sizes the write-back ahead of eviction (the bookkeeping is in
worker/core/cpu_slots.py, the copies in worker/kv_tier/copier.py). A worker without a tier has
`NullTierDriver`, which answers the same questions with "nothing to do".

With a tier on CUDA the tier's bulk copies occupy the copy engines, which take one direction's
transfers in turn whatever stream queued them; a step's own small copies (its staged inputs, its
sampled tokens) then go through a kernel instead (kernels/host_copy.py), set up here.
"""

from __future__ import annotations

import time

from spillway.kernels.host_copy import warm_up_copies
from spillway.worker.core.block_manager import BlockManager
from spillway.worker.runner.executor import Executor
from spillway.worker.driver.pipeline import LaunchedStep
from spillway.worker.core.scheduler import Scheduler
from spillway.worker.driver.timing import LandingDeadlines

def write_ahead_blocks(block_bytes: int, write_ahead_bytes: int) -> int:
    """Cached GPU blocks of `block_bytes` written back ahead of their eviction per step (the
    scheduler's `write_ahead_blocks`), `write_ahead_bytes` of them (worker/driver/timing.py)."""
    # The store stream is free again before the next step's stores, which the forward waits
    # for, are queued behind it (a batch is planned only once the one before has finished).
    # At most 64 blocks: the scheduler walks 4x that into the LRU every step.
    return min(64, max(1, write_ahead_bytes // block_bytes))


class TierDriver:
    """The CPU tier of one engine, between its scheduler and its executor's copier."""

    def __init__(self, block_manager: BlockManager, scheduler: Scheduler, executor: Executor,
                 deadlines: LandingDeadlines, idle_write_ahead_bytes: int) -> None:
        """`deadlines`: when to plan before a landing (`plan_before_landing`, `hold_in_flight`);
        `idle_write_ahead_bytes`: the cached blocks written back a batch while idle
        (`idle_write_back`; worker/driver/timing.py)."""
        assert block_manager.num_cpu_blocks and executor.kv_copier is not None
        self.tier, self.copier = block_manager.tier, executor.kv_copier
        self.block_manager, self.scheduler, self.executor = block_manager, scheduler, executor
        self.deadlines = deadlines
        self.block_bytes = executor.runner.kv_block_bytes
        self.idle_write_ahead_bytes = idle_write_ahead_bytes
        self.small_copies_by_kernel = executor.device.type == "cuda"
        if self.small_copies_by_kernel:
            warm_up_copies(executor.device)
            executor.runner.inputs.stage_by_kernel()

    def before_step(self) -> None:
        """What the device finished since the last step: load batches that landed (their
        requests compute from this step on), ahead stores that are done; and the loads still
        pending that may go now: at the paced rate while some request computes, else all."""
        if self.copier.pending_loads:
            self.copier.pump(pace=self.scheduler.num_running > self.scheduler.num_awaiting_load)
        if self.tier.num_loading:
            self.scheduler.loads_landed(self.copier.landed_through())
        if self.tier.num_ahead_pending and self.copier.ahead_stored():
            self.tier.complete_store()

    def stores_landed(self) -> None:
        """Tell the block manager which store batches the device has written into host memory
        (an event query): the CPU copies a producer may serve (`BlockManager.readable_prefix`)."""
        self.block_manager.stores_landed(self.copier.stored_through())

    def plan_before_landing(self, in_flight: LaunchedStep | None = None) -> bool:
        """Whether to plan the requests waiting for loads now (`Scheduler.schedule(
        before_landing=True)`), so that the host time of their step (and, where the loads land
        layer by layer, most of its device time) passes while the loads land: every running
        request waits for loads, all of them are queued on the device, and they should land
        within `plan_before_landing_s` (`KVCopier.loads_land_in`, an estimate on the host
        clock), or within `plan_overlapped_s` where they land layer by layer and no request
        arrived for `arrivals_quiet_s` (within `arrivals_deadline_s` whatever arrives).
        `in_flight`: the step on the device, if any; only one planned before the landing too,
        whose requests count as waiting (a burst's late members go behind it, once arrivals
        stop or within `plan_before_landing_s`: each such step costs a whole step's device
        time). Only on CUDA: elsewhere loads land as they are queued."""
        scheduler, deadlines = self.scheduler, self.deadlines
        if self.copier.load_stream is None or not scheduler.num_awaiting_load:
            return False
        beside = 0
        if in_flight is not None:
            if not in_flight.plan.kv_copies.wait_for_loads:
                return False
            beside = len(in_flight.plan.chunks)
        if scheduler.num_running != scheduler.num_awaiting_load + beside:
            return False
        land_in = self.copier.loads_land_in()
        if land_in is None or land_in > deadlines.plan_overlapped_s:
            return False
        if land_in <= deadlines.plan_before_landing_s:
            return True
        if not self.copier.lands_by_layer():
            return False
        quiet = time.monotonic() - scheduler.last_received >= deadlines.arrivals_quiet_s
        return quiet or (in_flight is None and land_in <= deadlines.arrivals_deadline_s)

    def hold_in_flight(self, step: LaunchedStep) -> bool:
        """Whether to leave `step` in flight rather than wait for its tokens, with nothing else
        to launch: it was planned before the landing, requests wait for loads that land in more
        than `hold_in_flight_s`, and the device has not finished it (its tokens go out as soon
        as the engine sees it has, `Engine.step`), so that late members can be planned behind
        it before the landing too."""
        if not step.plan.kv_copies.wait_for_loads or not self.scheduler.num_awaiting_load:
            return False
        land_in = self.copier.loads_land_in()
        return land_in is not None and land_in > self.deadlines.hold_in_flight_s and not step.finished()

    def awaited_load_landed(self) -> bool:
        """Whether a load batch some request waits for has landed since the last step (an event
        query): that request can compute in the next one."""
        awaited = self.scheduler.first_awaited_load
        return awaited is not None and self.copier.landed_through() >= awaited

    def idle_write_back(self) -> bool:
        """With no request to run: give cached GPU blocks without a CPU copy one, a batch at a
        time (the GPU LRU's head first, free CPU slots only), so that a later burst on CPU hits
        loads into their slots without stores in its way. Whether to call again soon: a batch
        is on its way, or was just started. Loads still pending (their requests were aborted)
        go first, at once: nothing computes."""
        self.copier.pump(pace=False)
        if self.tier.num_ahead_pending:
            if not self.copier.ahead_stored():
                return True
            self.tier.complete_store()
        batch = max(1, self.idle_write_ahead_bytes // self.block_bytes)
        # The next evicted 16 batches (2 GiB on the H200) at most: what a burst takes first,
        # found within a bounded walk of the LRU (a pool of a small model holds millions of blocks).
        if not self.block_manager.write_back_ahead(batch, 16 * batch):
            return False
        self.executor.copy_kv(self.block_manager.take_copies())
        return True

    def settle_loads(self) -> None:
        """Wait for every load still landing (before a prefix-cache reset frees their slots),
        when no request is left to wait for them."""
        if self.tier.num_loading and not self.scheduler.has_unfinished:
            self.scheduler.loads_landed(self.copier.landed_through(wait=True))


class NullTierDriver:
    """The engine's side of a worker without a CPU tier: no load to wait for or to plan
    before, nothing to write back."""

    small_copies_by_kernel = False

    def before_step(self) -> None:
        pass

    def stores_landed(self) -> None:
        pass

    def plan_before_landing(self, in_flight: LaunchedStep | None = None) -> bool:
        return False

    def hold_in_flight(self, step: LaunchedStep) -> bool:
        return False

    def awaited_load_landed(self) -> bool:
        return False

    def idle_write_back(self) -> bool:
        return False

    def settle_loads(self) -> None:
        pass
