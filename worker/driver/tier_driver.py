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

# Bytes of cached GPU blocks written back ahead of their eviction, per step, and per batch while
# the engine is idle (a request arriving meanwhile finds its stores queued behind at most ~2 ms
# of them).
WRITE_AHEAD_BYTES = 128 * 2**20
IDLE_WRITE_AHEAD_BYTES = 128 * 2**20
# While every running request waits for its loads, the step that computes them is planned before
# they land, its forward queued behind them on the device, so that its host time (~2 ms for one
# request on a 10k-token prefix, 4-7 ms for 50 on the H200's host) passes while they land: once
# they should land within PLAN_BEFORE_LANDING_S. Where the loads land layer by layer
# (worker/kv_tier/copier.py) its forward computes each layer as it lands, so it is planned sooner,
# once they should land within PLAN_OVERLAPPED_S, and most of its device time (5.6 ms for one
# request, 11.4 for 50 on the H200) passes meanwhile too; but not while requests still come in
# (none for ARRIVALS_QUIET_S): a burst on one prefix reaches the worker over ~10 ms, and a member
# that arrives after the plan computes in the step after, which waits behind it. Once they land
# within ARRIVALS_DEADLINE_S it is planned whatever still arrives: a burst's step planned later
# than that (its host time, ~3.5 ms for 50, then ~11 ms of device time for 50 on a 10k-token
# prefix) no longer overlaps the loads, and every member waits for the stragglers' step's whole
# device time after the landing, where a straggler left out waits for one step more.
PLAN_BEFORE_LANDING_S = 0.006
PLAN_OVERLAPPED_S = 0.02
ARRIVALS_QUIET_S = 0.003
ARRIVALS_DEADLINE_S = 0.014
# Members that arrive after that step was launched wait for the same loads: while those land in
# more than HOLD_IN_FLIGHT_S the engine leaves the step in flight instead of waiting for its
# tokens, so that the late members' step can be planned before the landing too (once arrivals
# stop, or within PLAN_BEFORE_LANDING_S), queued behind it on the device; closer to the landing
# it waits for the first step's tokens, which come ~1-2 ms after the landing.
HOLD_IN_FLIGHT_S = 0.002


def write_ahead_blocks(block_bytes: int) -> int:
    """Cached GPU blocks of `block_bytes` written back ahead of their eviction per step (the
    scheduler's `write_ahead_blocks`)."""
    # ~2 ms of copy a step at ~55 GB/s: the store stream is free again before the next
    # step's stores, which the forward waits for, are queued behind it (a batch is planned
    # only once the one before has finished). At most 64 blocks: the scheduler walks 4x
    # that into the LRU every step.
    return min(64, max(1, WRITE_AHEAD_BYTES // block_bytes))


class TierDriver:
    """The CPU tier of one engine, between its scheduler and its executor's copier."""

    def __init__(self, block_manager: BlockManager, scheduler: Scheduler, executor: Executor) -> None:
        assert block_manager.num_cpu_blocks and executor.kv_copier is not None
        self.tier, self.copier = block_manager.tier, executor.kv_copier
        self.block_manager, self.scheduler, self.executor = block_manager, scheduler, executor
        self.block_bytes = executor.runner.kv_block_bytes
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

    def plan_before_landing(self, in_flight: LaunchedStep | None = None) -> bool:
        """Whether to plan the requests waiting for loads now (`Scheduler.schedule(
        before_landing=True)`): every running request waits for loads, all of them are queued
        on the device, and they should land within PLAN_BEFORE_LANDING_S (`KVCopier.loads_land_in`,
        an estimate on the host clock), or within PLAN_OVERLAPPED_S where they land layer by
        layer and no request arrived for ARRIVALS_QUIET_S (within ARRIVALS_DEADLINE_S whatever
        arrives). `in_flight`: the step on the device, if any; only one planned before the
        landing too, whose requests count as waiting (a burst's late members go behind it,
        once arrivals stop or within PLAN_BEFORE_LANDING_S: each such step costs a whole
        step's device time). Only on CUDA: elsewhere loads land as they are queued."""
        scheduler = self.scheduler
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
        if land_in is None or land_in > PLAN_OVERLAPPED_S:
            return False
        if land_in <= PLAN_BEFORE_LANDING_S:
            return True
        if not self.copier.lands_by_layer():
            return False
        quiet = time.monotonic() - scheduler.last_received >= ARRIVALS_QUIET_S
        return quiet or (in_flight is None and land_in <= ARRIVALS_DEADLINE_S)

    def hold_in_flight(self, step: LaunchedStep) -> bool:
        """Whether to leave `step` in flight rather than wait for its tokens, with nothing else
        to launch: it was planned before the landing, requests wait for loads that land in more
        than HOLD_IN_FLIGHT_S, and the device has not finished it (its tokens go out as soon as
        the engine sees it has, `Engine.step`)."""
        if not step.plan.kv_copies.wait_for_loads or not self.scheduler.num_awaiting_load:
            return False
        land_in = self.copier.loads_land_in()
        return land_in is not None and land_in > HOLD_IN_FLIGHT_S and not step.finished()

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
        batch = max(1, IDLE_WRITE_AHEAD_BYTES // self.block_bytes)
        # The next evicted 16 batches (2 GiB) at most: what a burst takes first, found within a
        # bounded walk of the LRU (a pool of a small model holds millions of blocks).
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
