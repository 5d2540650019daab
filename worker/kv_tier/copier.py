"""The CPU tier's KV pool and the copies of blocks between it and the GPU pool.

Both pools have the runner's layout, `[num_blocks, num_layers, kv_sides, block_size, kv_heads,
head_dim]` (`ModelRunner.kv_cache_shape`), so a block is one contiguous span and a copy of a run of consecutive slots is
one DMA transfer. On CUDA the CPU pool is pinned and a step's copies run on two copy streams
of their own, stores on one and loads on the other, so that the two directions' copy engines
work at once; events order them:

    store stream:   wait for compute ─ stores (GPU->CPU) ─● stored
    load stream:    wait for compute ─ (wait stored) ─ loads (CPU->GPU) ─● landed (batch n)
    compute stream: ... step N-1 ... ─ wait stored ─ step N's forward ─ step N+1 ...

- Both copy streams first wait for everything compute has queued, so a store reads a block
  after its KV was written and a load never overwrites a slot an earlier step still reads.
- This step's forward waits for the stores only: the GPU slots they read may be rewritten by
  it (the block manager reuses an evicted block's slot at once).
- A forward waits for loads only when its step sets `wait_for_loads`. A request computes on
  loaded blocks from the first step planned after the host saw their batch land
  (`landed_through`, an event query per batch: anything queued after that runs after the
  copies), so a request waits for its own loads only, never for loads planned after them.
  Two steps wait for every load queued: one that reuses a GPU slot whose load may still run
  (its request went first, and its block was evicted), and one planned before the landing
  while nothing else runs (worker/driver/tier_driver.py `plan_before_landing`: its host time passes
  while the loads land). `loads_land_in` estimates the landing on the host clock from the
  bytes queued and the loads' timed speed.
- Loads go a group of layers at a time, first layers first (worker/kv_tier/paced_loads.py), with an
  event per layer after that layer of every load queued. A step planned before the landing
  (`wait_by_layer`) gets them from `run`, and its graph's segments each wait for their own
  (worker/kv_tier/step_graphs.py): it computes the first layers while the last ones arrive.

    load stream:    ... layers 0-3 ─● ─ layers 4-7 ─● ─ ... ─ layers 32-35 ─●
    compute stream:   wait ─ graph 0 ─ wait ─ graph 1 ─ ... ─ wait ─ graph 8 ─ logits
- A load into a GPU slot that a store of the same step reads waits for the stores (the
  block manager may give an evicted block's slot to a block loaded in the same step); when
  the step's load destinations and store sources are disjoint, both directions run at once.
  A CPU slot is never a store's destination while a load may read it: the tier holds a
  loaded block's CPU copy out of its LRU until the load lands (worker/core/cpu_slots.py), so no
  other wait is needed between the two streams.

Stores ahead of eviction (`KVCopies.ahead_to_cpu`, worker/core/cpu_slots.py) queue on the store
stream after the step's stores, behind an event of their own that compute does not wait for;
a later step that reuses one of their GPU slots (`wait_for_ahead`) makes its forward and its
loads wait for that event. `ahead_stored` asks the device whether they have finished.

A step's stores of both kinds are one store batch (`KVCopies.store_batch`), with an event after
its last copy on the store stream; `stored_through` asks the device which batches have finished
writing the CPU pool, whose copies may then be read on the host (a producer serving blocks from
the tier, worker/core/cpu_slots.py).

While other requests compute, loads are queued in chunks no faster than a set rate
(worker/kv_tier/paced_loads.py): their events (compute's queue when their step was planned, the step's
stores) are recorded at `run`, and `pump` queues what the rate allows since. A step that waits
for loads (`wait_for_loads`) first queues every chunk still pending, as does waiting for them all.

Each direction is timed by events on its own stream (a load's time starts after its wait). On
the CPU device the same copies run in order, synchronously.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence

import torch

from spillway.worker.kv_tier.block_copies import block_runs, copy_blocks, copy_layers, copy_runs
from spillway.worker.kv_tier.paced_loads import LoadChunk, PacedLoads
from spillway.worker.core.step_plan import KVCopies


def _overlap(copies: KVCopies) -> bool:
    """Whether a load of the step must wait for its stores: it refills a GPU slot a store
    reads, or reads a CPU slot a store writes (one stream ordered stores first; the two
    streams keep that order where it matters)."""
    if not copies.gpu_to_cpu or not copies.cpu_to_gpu:
        return False
    stored_gpu, stored_cpu = zip(*copies.gpu_to_cpu)
    loaded_cpu, loaded_gpu = zip(*copies.cpu_to_gpu)
    return not set(stored_gpu).isdisjoint(loaded_gpu) or not set(stored_cpu).isdisjoint(loaded_cpu)


class KVCopier:
    """Runs each step's `KVCopies` between the GPU pool and the CPU pool (module doc), and
    counts the bytes and the time they took."""

    def __init__(self, gpu_pool: torch.Tensor, cpu_pool: torch.Tensor, load_bytes_per_s: float,
                 load_burst_s: float, load_speed_guess: float) -> None:
        """`load_bytes_per_s` and `load_burst_s`: the loads' pace while others compute (0: never
        paced) and what a quiet spell saves up of it (worker/kv_tier/paced_loads.py);
        `load_speed_guess`: a load's speed until some are timed (`load_speed`)."""
        self.gpu_pool = gpu_pool
        self.cpu_pool = cpu_pool
        self.block_bytes = gpu_pool[0].nbytes
        on_cuda = gpu_pool.device.type == "cuda"
        self.store_stream = torch.cuda.Stream(gpu_pool.device) if on_cuda else None
        self.load_stream = torch.cuda.Stream(gpu_pool.device) if on_cuda else None
        self.num_layers = gpu_pool.shape[1]
        self.pending_loads = PacedLoads(self.block_bytes, load_bytes_per_s, load_burst_s, self.num_layers)
        self._last_loads: torch.cuda.Event | None = None  # after every load queued so far
        # Per layer, an event after that layer of every load queued so far (once every chunk of
        # the last batch is queued; None after a batch in whole blocks): what a forward planned
        # before the landing waits for.
        self._layer_landed: list[torch.cuda.Event | None] = [None] * self.num_layers
        # (load batch, event after its loads) of the batches not known to have landed, in order
        self._load_events: deque[tuple[int, torch.cuda.Event]] = deque()
        self._landed_through = 0  # the last load batch known to have landed
        self._ahead_stored: torch.cuda.Event | None = None  # after the last stores ahead of eviction
        # (store batch, event after its copies) of the batches not known to have finished, in order
        self._store_events: deque[tuple[int, torch.cuda.Event]] = deque()
        self._stored_through = 0  # the last store batch known to have finished
        # (started, finished) events per direction of the steps whose times are not read yet
        self._store_timings: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._load_timings: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._load_sizes: deque[int] = deque()  # the bytes of each entry of _load_timings
        # The loads' own speed, from the timed ones (a paced chunk times its copy alone), and
        # the host clock's estimate of when the loads queued so far will have landed.
        self.load_speed_guess = load_speed_guess
        self._timed_load_bytes = 0
        self._timed_load_seconds = 0.0
        self._loads_done_at = 0.0
        self.bytes_to_cpu = 0
        self.bytes_to_gpu = 0
        self._seconds_to_cpu = 0.0
        self._seconds_to_gpu = 0.0

    def run(self, copies: KVCopies, pace: bool = False) -> list[torch.cuda.Event] | None:
        """Start the step's copies: stores on the store stream, loads on the load stream (after
        the stores when a load fills a GPU slot a store reads). Call before the step's forward.
        `pace`: other requests compute, so loads go no faster than the set rate (module doc).

        Returns, for a step that waits for the loads layer by layer (`wait_by_layer`), an event
        per layer that the forward waits for before that layer; otherwise None (any wait the
        forward needs is queued on the compute stream here)."""
        self.seconds()  # fold the finished timings: the lists stay short without stats reads
        self.stored_through()  # and the finished store batches
        self.bytes_to_cpu += (len(copies.gpu_to_cpu) + len(copies.ahead_to_cpu)) * self.block_bytes
        self.bytes_to_gpu += len(copies.cpu_to_gpu) * self.block_bytes
        if self.store_stream is None:
            started = time.perf_counter()
            copy_blocks(self.gpu_pool, self.cpu_pool, copies.gpu_to_cpu + copies.ahead_to_cpu)
            stored = time.perf_counter()
            copy_blocks(self.cpu_pool, self.gpu_pool, copies.cpu_to_gpu)
            self._seconds_to_cpu += stored - started
            self._seconds_to_gpu += time.perf_counter() - stored
            self._landed_through = max(self._landed_through, copies.load_batch)
            self._stored_through = max(self._stored_through, copies.store_batch)
            return None
        compute = torch.cuda.current_stream(self.gpu_pool.device)
        if copies.wait_for_ahead and self._ahead_stored is not None:
            # A GPU slot an ahead store reads is reused by this step: its forward writes it,
            # and a load may fill it.
            compute.wait_event(self._ahead_stored)
            self.load_stream.wait_event(self._ahead_stored)
        layer_waits = None
        if copies.wait_for_loads:
            self.pump(pace=False)
            if copies.wait_by_layer and self.lands_by_layer():
                layer_waits = list(self._layer_landed)
            elif self._last_loads is not None:
                compute.wait_event(self._last_loads)
        # Stores never wait for loads: the CPU slot a load reads is held out of the CPU LRU until
        # it lands (worker/core/cpu_slots.py), and a block still loading has its CPU copy, so it is
        # never stored. A direction with nothing to copy queues nothing: an empty batch of
        # stores would make the forward wait for whatever the store stream still runs (the
        # ahead stores of a step before).
        stored = None
        if copies.gpu_to_cpu or copies.ahead_to_cpu:
            self.store_stream.wait_stream(compute)
        if copies.gpu_to_cpu:
            stored = self._queue(self.store_stream, self.gpu_pool, self.cpu_pool, block_runs(copies.gpu_to_cpu),
                                 self._store_timings)
        if copies.ahead_to_cpu:
            self._ahead_stored = self._queue(self.store_stream, self.gpu_pool, self.cpu_pool,
                                             block_runs(copies.ahead_to_cpu), self._store_timings)
        if copies.store_batch:  # after its last copy: the ahead stores queue behind the others
            events = self._store_events
            assert not events or events[-1][0] < copies.store_batch, "store batches out of order"
            events.append((copies.store_batch, self._ahead_stored if copies.ahead_to_cpu else stored))
        start, after = 0, stored if _overlap(copies) else None
        if copies.cpu_to_gpu:
            ready = torch.cuda.Event()
            ready.record(compute)
            for batch, end in copies.load_batches():  # an event per batch: each request's loads land on their own
                self.pending_loads.add(copies.cpu_to_gpu[start:end], ready, after, batch)
                start, after = end, None
            self.pump(pace)
        if stored is not None:
            compute.wait_event(stored)
        return layer_waits

    def pump(self, pace: bool) -> None:
        """Queue the pending loads that the rate allows by now (all of them unless `pace`)."""
        for chunk in self.pending_loads.take(pace):
            self._queue_load(chunk)

    def _queue_load(self, chunk: LoadChunk) -> None:
        """Queue one chunk of loads after the compute its step came after (and its stores)."""
        self.load_stream.wait_event(chunk.ready)
        if chunk.after is not None:
            self.load_stream.wait_event(chunk.after)
        layers = None if chunk.num_layers == self.num_layers else (chunk.first_layer, chunk.num_layers)
        self._last_loads = self._queue(self.load_stream, self.cpu_pool, self.gpu_pool, chunk.runs,
                                       self._load_timings, layers)
        if chunk.layers_end:  # a batch in whole blocks leaves no layer landed apart: none to wait for by layer
            for layer in range(chunk.first_layer, chunk.first_layer + chunk.num_layers):
                self._layer_landed[layer] = self._last_loads if layers is not None else None
        size = chunk.nbytes
        self._load_sizes.append(size)
        self._loads_done_at = max(time.monotonic(), self._loads_done_at) + size / self.load_speed()
        if chunk.batch:
            self._load_events.append((chunk.batch, self._last_loads))

    @staticmethod
    def _queue(stream: torch.cuda.Stream, src: torch.Tensor, dst: torch.Tensor, runs: Sequence[tuple[int, int, int]],
               timings: list[tuple[torch.cuda.Event, torch.cuda.Event]],
               layers: tuple[int, int] | None = None) -> torch.cuda.Event:
        """Queue the copies of `runs` (`block_runs`) on `stream` (after what it waits for
        already), whole blocks or `layers` (first, count) of them, between two timing events;
        returns the one after the copies."""
        started, finished = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            started.record()
            if layers is None:
                copy_runs(src, dst, runs)
            else:
                copy_layers(src, dst, runs, *layers)
            finished.record()
        timings.append((started, finished))
        return finished

    def wait_for_queued(self) -> None:
        """Make the compute stream wait for every copy queued so far, both ways (the pending
        loads queued first): for a tensor-parallel rank other than 0, which runs rank 0's
        copies without knowing when rank 0 saw them land (worker/tp/rank.py)."""
        if self.store_stream is None:
            return
        self.pump(pace=False)
        compute = torch.cuda.current_stream(self.gpu_pool.device)
        compute.wait_stream(self.store_stream)
        compute.wait_stream(self.load_stream)

    def ahead_stored(self) -> bool:
        """Whether every store ahead of eviction queued so far has finished (an event query);
        on the CPU the copies ran when queued."""
        return self._ahead_stored is None or self._ahead_stored.query()

    def stored_through(self) -> int:
        """The last store batch (`KVCopies.store_batch`) whose copies are all in the CPU pool:
        batches finish in order, on one stream. Asks the device without waiting; on the CPU the
        copies ran when queued."""
        events = self._store_events
        while events and events[0][1].query():
            self._stored_through = events.popleft()[0]
        return self._stored_through

    def landed_through(self, wait: bool = False) -> int:
        """The last load batch (`KVCopies.load_batch`) that has landed: batches land in
        order, on one stream. Asks the device without waiting (`wait`: queues every pending
        load and waits for them all); on the CPU the copies ran when queued."""
        if wait:
            self.pump(pace=False)
        events = self._load_events
        while events and (wait or events[0][1].query()):
            batch, event = events.popleft()
            if wait:
                event.synchronize()
            self._landed_through = max(self._landed_through, batch)
        if not events and not self.pending_loads:
            self._last_loads = None  # nothing in flight: a reused slot need not wait
        return self._landed_through

    def time_copies(self, num_blocks: int, scattered: bool = False) -> tuple[float, float]:
        """Seconds to store GPU slots 0..num_blocks-1 into the same CPU slots, then to load them
        back, through `run` (every other slot when `scattered`: one transfer per block); waits
        for both. For benchmarks: the pools' contents are overwritten."""
        step = 2 if scattered else 1
        if num_blocks * step > min(len(self.gpu_pool), len(self.cpu_pool)):
            raise ValueError(f"{num_blocks} blocks{' scattered' if scattered else ''} do not fit the pools")
        slots = range(0, num_blocks * step, step)
        pairs = tuple(zip(slots, slots))
        self._synchronize()
        before = self.seconds()
        self.run(KVCopies(gpu_to_cpu=pairs))
        self.run(KVCopies(cpu_to_gpu=pairs))
        self._synchronize()
        after = self.seconds()
        return after[0] - before[0], after[1] - before[1]

    def _synchronize(self) -> None:
        if self.store_stream is not None:
            torch.cuda.synchronize(self.gpu_pool.device)

    def seconds(self) -> tuple[float, float]:
        """Cumulative seconds of the stores and of the loads (on CUDA, of those finished)."""
        self._seconds_to_cpu += self._finished_seconds(self._store_timings)[0]
        load_seconds, count = self._finished_seconds(self._load_timings)
        self._seconds_to_gpu += load_seconds
        self._timed_load_seconds += load_seconds
        for _ in range(count):
            self._timed_load_bytes += self._load_sizes.popleft()
        return self._seconds_to_cpu, self._seconds_to_gpu

    def load_speed(self) -> float:
        """Bytes a second of a load on its own: the timed loads' average once there are 10 ms
        of them, else `load_speed_guess`. Only the estimate of when loads land uses it
        (`loads_land_in`)."""
        if self._timed_load_seconds < 0.01:
            return self.load_speed_guess
        return self._timed_load_bytes / self._timed_load_seconds

    def lands_by_layer(self) -> bool:
        """Whether the loads queued so far land layer by layer (the last batch went in groups
        of layers), so a forward queued behind them can wait for each layer (`wait_by_layer`)."""
        return self._last_loads is not None and None not in self._layer_landed

    def loads_land_in(self) -> float | None:
        """Seconds until every load queued so far should have landed, by the host clock and the
        loads' speed (an estimate: the device is not asked); 0 when that time has passed, None
        while loads wait to be queued (their time depends on the pace)."""
        if self.pending_loads:
            return None
        return max(0.0, self._loads_done_at - time.monotonic())

    @staticmethod
    def _finished_seconds(timings: list[tuple[torch.cuda.Event, torch.cuda.Event]]) -> tuple[float, int]:
        """Seconds of the finished (started, finished) pairs at the head of `timings`, which
        leave it (one stream's copies finish in order), and how many left."""
        seconds, count = 0.0, 0
        while timings and timings[0][1].query():
            started, finished = timings.pop(0)
            seconds += started.elapsed_time(finished) / 1000
            count += 1
        return seconds, count
