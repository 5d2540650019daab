"""A scheduler over a block manager with (or without) a CPU tier, driven by a fake model over
two simulated KV pools that keep the timing of the CUDA path.

Each step: the plan's stores run (GPU slot -> CPU slot), then every chunk reads its context
from the GPU pool (each position must hold exactly its own (position, token)) and writes its
tokens. The plan's loads (CPU slot -> GPU slot, a batch per request) land later: at the start
of the next step (`land_delay` 0), or each batch a random 0..`land_delay` steps later, in order, with the
scheduler told then (`loads_landed`), as the engine learns it from the device. Only a step
with `wait_for_loads` (it reuses a GPU slot a load may still write) lands every load queued
before it first; stores never wait for loads, so a store into a CPU slot that a load still
reads hands that load the wrong KV. A chunk that read a block before its load landed,
or a slot reused before its store ran, fails the step. The sampled token is a function of the
context read back from the pool, so any wrong KV also changes the outputs.

Stores ahead of eviction (`write_ahead_blocks`) run as late as the engine allows: at the end
of the step after the one that planned them, after its forward, unless a step waits for them
(`wait_for_ahead`) or queues stores behind them (one store stream) first. A slot reused without that wait hands the CPU copy the new block's
KV, which a later load then brings back to the wrong request's positions.

A step's store batch (`KVCopies.store_batch`) has run once all its stores, ahead ones included,
have; the host hears of it (`stores_landed`, as the engine's event query) 1..1+`land_delay`
steps later, in order, and until then does not know what the CPU slots it wrote hold. With
`check_serves`, after every step the harness plays a producer serving each request's tokens so
far (`readable_prefix`, as between two steps): every block it says may be read must hold
exactly its own (position, token) in the pool named, and a CPU slot must not be one whose
store the host has not heard of.
"""

from __future__ import annotations

import random

from spillway.protocol.hashing import DEFAULT_HASH_SEED, block_hashes, root_hash
from spillway.protocol.messages import Generate, SamplingParams
from spillway.worker.core.block_manager import BlockManager
from spillway.worker.core.request import Request
from spillway.worker.core.scheduler import Scheduler, StepPlan, StepResult

ROOT = root_hash(DEFAULT_HASH_SEED, "tier-model")
NO_EOS = 999
VOCAB = 50


class TierHarness:
    def __init__(self, *, num_gpu_blocks: int, num_cpu_blocks: int = 0, block_size: int = 4,
                 max_num_seqs: int = 8, max_num_batched_tokens: int = 64, max_model_len: int = 64,
                 write_ahead_blocks: int = 0, land_delay: int = 0, seed: int = 0, kv_events: bool = False) -> None:
        self.block_size = block_size
        self.manager = BlockManager(num_gpu_blocks, block_size, True, num_cpu_blocks, kv_events=kv_events)
        self.scheduler = Scheduler(self.manager, max_num_seqs=max_num_seqs,
                                   max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
                                   block_size=block_size, root_hash=ROOT, eos_token_ids=[NO_EOS],
                                   write_ahead_blocks=write_ahead_blocks)
        self.pending_ahead: tuple[tuple[int, int], ...] = ()  # planned a step ago, not run yet
        self.pending_ahead_batch = 0  # the store batch they complete
        self.store_rng = random.Random(seed + 1)  # apart: the loads' timings stay those of `seed`
        self.store_reports: list[tuple[int, int]] = []  # (store batch, the step from which it is heard of)
        self.unheard_slots: dict[int, int] = {}  # CPU slot -> the batch whose store the host has not heard of
        self.check_serves = False
        self.served = {"gpu": 0, "cpu": 0}  # blocks found readable and checked, per pool
        self.land_delay = land_delay
        self.rng = random.Random(seed)
        self.hold_loads = False  # the device has not finished any load yet: nothing is reported
        # As the engine on a GPU does when the loads are about to land: while every running
        # request waits for loads, plan them anyway, the step waiting for the loads.
        self.plan_before_landing = False
        # Loads queued and not landed: (batch, pairs, the step index from which it may land).
        self.in_flight: list[tuple[int, tuple[tuple[int, int], ...], int]] = []
        self.applied_through = 0  # loads applied to the GPU pool, not all reported yet
        self.num_steps = 0
        self.gpu: dict[tuple[int, int], tuple[int, int]] = {}  # (slot, offset) -> (position, token)
        self.cpu: dict[tuple[int, int], tuple[int, int]] = {}
        self.num_added = 0
        self.outputs: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}  # request id -> tokens computed, over every chunk
        self.cached: dict[str, int] = {}  # request id -> num_cached_tokens reported
        self.plans: list[StepPlan] = []
        self.requests: list[Request] = []

    def add(self, request_id: str, prompt: list[int], max_tokens: int = 8, seed: int | None = None) -> Request:
        msg = Generate(request_id=request_id, prompt_token_ids=prompt,
                       block_hashes=block_hashes(prompt, self.block_size, ROOT),
                       params=SamplingParams(max_tokens=max_tokens, seed=seed))
        self.num_added += 1
        request = Request.from_generate(msg, arrival_index=self.num_added)
        self.scheduler.add(request)
        self.requests.append(request)
        return request

    def _copy(self, src: dict, dst: dict, src_slot: int, dst_slot: int) -> None:
        for offset in range(self.block_size):
            value = src.get((src_slot, offset))
            if value is None:
                dst.pop((dst_slot, offset), None)
            else:
                dst[(dst_slot, offset)] = value

    def _apply_loads(self, through: int) -> None:
        """The loads of batches up to `through` write the GPU pool (in order)."""
        while self.in_flight and self.in_flight[0][0] <= through:
            batch, pairs, _ = self.in_flight.pop(0)
            for cpu_slot, gpu_slot in pairs:
                self._copy(self.cpu, self.gpu, cpu_slot, gpu_slot)
            self.applied_through = batch

    def _report_landed(self) -> None:
        """Batches whose time has come land; the scheduler hears of every batch applied."""
        if self.hold_loads:
            return
        while self.in_flight and self.in_flight[0][2] <= self.num_steps:
            self._apply_loads(self.in_flight[0][0])
        self.scheduler.loads_landed(self.applied_through)

    def step(self) -> tuple[StepPlan, list[StepResult]]:
        self.num_steps += 1
        self._report_landed()
        self._report_stored()
        if not self.pending_ahead:
            self.manager.tier.complete_store()
        scheduler = self.scheduler
        early = (self.plan_before_landing and scheduler.num_awaiting_load > 0
                 and scheduler.num_running == scheduler.num_awaiting_load)
        plan = scheduler.schedule(before_landing=early)
        self.plans.append(plan)
        copies = plan.kv_copies
        if copies.wait_for_loads:
            self._apply_loads(self.in_flight[-1][0] if self.in_flight else 0)
        if copies.wait_for_ahead or copies.gpu_to_cpu:
            self._store_ahead()  # waited for; or the step's stores queue behind them on one stream
        for gpu_slot, cpu_slot in plan.kv_copies.gpu_to_cpu:
            self._copy(self.gpu, self.cpu, gpu_slot, cpu_slot)
        self._stores_ran(copies.gpu_to_cpu, copies.store_batch, batch_done=not copies.ahead_to_cpu)
        sampled = {}
        bs = self.block_size
        for chunk in plan.chunks:
            request = chunk.request
            tokens, end = request.all_token_ids, chunk.start + chunk.num_tokens
            for pos in range(chunk.start):
                found = self.gpu.get((chunk.slot_table[pos // bs], pos % bs))
                assert found == (pos, tokens[pos]), (request.request_id, pos, found)
            for pos in range(chunk.start, end):
                self.gpu[(chunk.slot_table[pos // bs], pos % bs)] = (pos, tokens[pos])
            self.computed[request.request_id] = self.computed.get(request.request_id, 0) + chunk.num_tokens
            if chunk.sample:
                context = [self.gpu[(chunk.slot_table[pos // bs], pos % bs)][1] for pos in range(end)]
                salt = request.params.seed or 0
                sampled[request.request_id] = sum((i + 1) * t for i, t in enumerate(context)) * 31 % VOCAB + salt
        start = 0
        for batch, end in copies.load_batches():  # one batch per request, landing in order
            ready = self.num_steps + 1 + self.rng.randint(0, self.land_delay)
            if self.in_flight:
                ready = max(ready, self.in_flight[-1][2])
            self.in_flight.append((batch, copies.cpu_to_gpu[start:end], ready))
            start = end
        self._store_ahead()
        self.pending_ahead, self.pending_ahead_batch = copies.ahead_to_cpu, copies.store_batch
        results = self.scheduler.update(plan, sampled)
        self.manager.check_invariants()
        if self.check_serves:
            self._check_serves()
        for result in results:
            self.outputs.setdefault(result.request.request_id, []).extend(result.new_token_ids)
            if result.num_cached_tokens >= 0:
                self.cached[result.request.request_id] = result.num_cached_tokens
        return plan, results

    def _store_ahead(self) -> None:
        for gpu_slot, cpu_slot in self.pending_ahead:
            self._copy(self.gpu, self.cpu, gpu_slot, cpu_slot)
        if self.pending_ahead:
            self._stores_ran(self.pending_ahead, self.pending_ahead_batch, batch_done=True)
        self.pending_ahead, self.pending_ahead_batch = (), 0

    def _stores_ran(self, pairs: tuple[tuple[int, int], ...], batch: int, batch_done: bool) -> None:
        """Stores of `batch` ran (its last ones when `batch_done`): the host hears of it later."""
        for _, cpu_slot in pairs:
            self.unheard_slots[cpu_slot] = batch
        if batch_done and batch:
            heard = self.num_steps + 1 + self.store_rng.randint(0, self.land_delay)
            if self.store_reports:
                heard = max(heard, self.store_reports[-1][1])
            self.store_reports.append((batch, heard))

    def _report_stored(self) -> None:
        """The store batches whose time has come are heard of (`stores_landed`)."""
        while self.store_reports and self.store_reports[0][1] <= self.num_steps:
            batch, _ = self.store_reports.pop(0)
            self.manager.stores_landed(batch)
            self.unheard_slots = {slot: last for slot, last in self.unheard_slots.items() if last > batch}

    def _check_serves(self) -> None:
        """Every block a producer would serve now holds its own tokens in the pool it is read from."""
        bs = self.block_size
        for request in self.requests:
            tokens = request.all_token_ids
            prefix = self.manager.readable_prefix(block_hashes(tokens, bs, ROOT))
            for pool, name, reads in ((self.gpu, "gpu", prefix.gpu_reads), (self.cpu, "cpu", prefix.cpu_reads)):
                for slot, position in reads:
                    assert name == "gpu" or slot not in self.unheard_slots, (request.request_id, slot)
                    for pos in range(position * bs, (position + 1) * bs):
                        found = pool.get((slot, pos % bs))
                        assert found == (pos, tokens[pos]), (request.request_id, name, slot, pos, found)
                self.served[name] += len(reads)

    def run(self, max_steps: int = 1000) -> None:
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished:
                return
            self.step()
        raise AssertionError("requests left unfinished")
