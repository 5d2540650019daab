"""The deadlines, budgets and paces of the busy loop and the CPU tier, derived from what the
worker measures at start-up.

Each was sized on one machine, Qwen3-8B on an H200 (docs/performance.md), where that model's
batch-1 decode step replays in `REFERENCE_DECODE_STEP_S` and a pinned host-to-device copy runs
at `REFERENCE_COPY_BYTES_PER_S`. A worker scales each by its own measurement against those: a
model or a device whose step takes twice as long gets deadlines twice as long, a link half as
fast writes half the bytes back a step. On an H200 serving Qwen3-8B the scale is ~1 and the
values are the ones sized there, within the measurement's noise. Parts of some are the
host's time (planning a step) or the clients' (how a burst spreads), which the device's step
does not measure; they scale with it too, the nearest measure the worker has at start-up.

    decode step (worker/runner/step_time.py)  -> the landing's deadlines, intake budgets, load burst
    copy rate (worker/kv_tier/host_pool.py)     -> the loads' speed until timed, write-back sizes

The loads' pace is a setting instead (`WorkerConfig.kv_load_gb_s`): what it bounds is the
decode step's slowdown from sharing HBM with the loads, which the link's rate does not tell.
"""

from __future__ import annotations

from dataclasses import dataclass

# Qwen3-8B on one H200 (docs/performance.md): the batch-1 decode graph's replay alone, and a
# pinned tensor's host-to-device `copy_`.
REFERENCE_DECODE_STEP_S = 4.505e-3
REFERENCE_COPY_BYTES_PER_S = 55.2e9


@dataclass(frozen=True, slots=True)
class LandingDeadlines:
    """When the requests that wait for CPU-tier loads are planned before the loads land, and
    when a step planned so stays in flight (worker/driver/tier_driver.py). On the H200, in
    order: 6, 20, 3, 14 and 2 ms."""

    # Once the loads should land within this, the step that computes them is planned, its
    # forward queued behind them, so its host time (~2 ms for one request on a 10k-token prefix,
    # 4-7 ms for 50 on the H200's host) passes while they land.
    plan_before_landing_s: float
    # Where they land layer by layer the forward computes each layer as it lands, so it is
    # planned sooner: most of its device time (5.6 ms for one request, 11.4 for 50) passes
    # meanwhile too ...
    plan_overlapped_s: float
    # ... but not while requests still come in (none for this long): a burst on one prefix
    # reaches the worker over ~10 ms, and a member that arrives after the plan computes in the
    # step after, which waits behind it ...
    arrivals_quiet_s: float
    # ... and within this whatever still arrives: a burst's step planned later (its host time,
    # ~3.5 ms for 50, then ~11 ms of device time) no longer overlaps the loads, and every
    # member would wait for the stragglers' whole step after the landing.
    arrivals_deadline_s: float
    # A step planned before the landing stays in flight while the loads land in more than this,
    # so that late members can be planned behind it; closer to the landing the engine waits for
    # its tokens, which come ~1-2 ms after the landing (about one graph segment's compute).
    hold_in_flight_s: float


@dataclass(frozen=True, slots=True)
class StepTiming:
    """What scales with the model's step time."""

    landing: LandingDeadlines
    # How long one iteration of the busy loop takes messages in while there is work: a burst of
    # arrivals (each a decode and an add, ~0.1-1 ms for a long prompt) must not hold back the
    # step that commits tokens already computed, nor the admission of those taken in so far.
    drain_budget_s: float
    # The same while nothing can compute before loads land: a burst on one long prefix is taken
    # in slices, each followed by a step that admits it (~0.3 ms a 10k-token request), so those
    # in by the landing are admitted when it lands and the step after it computes them all.
    # Taken for 20 ms at once, a fast burst (35 requests, from several API servers) was admitted
    # in one 12 ms step after the landing.
    landing_drain_budget_s: float
    # The most a quiet spell saves up of the loads' pace (worker/kv_tier/paced_loads.py), in
    # seconds of it: the first chunks after a quiet spell go at once, beside a step or two.
    load_burst_s: float

    @classmethod
    def derive(cls, decode_step_s: float) -> StepTiming:
        """The values for a model whose batch-1 decode step takes `decode_step_s`."""
        if not decode_step_s > 0:
            raise ValueError(f"a measured step time must be positive, got {decode_step_s}")
        scale = decode_step_s / REFERENCE_DECODE_STEP_S
        return cls(
            landing=LandingDeadlines(plan_before_landing_s=0.006 * scale, plan_overlapped_s=0.02 * scale,
                                     arrivals_quiet_s=0.003 * scale, arrivals_deadline_s=0.014 * scale,
                                     hold_in_flight_s=0.002 * scale),
            drain_budget_s=0.002 * scale,
            landing_drain_budget_s=0.005 * scale,
            load_burst_s=0.01 * scale,
        )


@dataclass(frozen=True, slots=True)
class LinkTiming:
    """What scales with the host-to-device copy rate (a worker with a CPU tier)."""

    # The speed a load's landing is estimated at until 10 ms of loads have been timed
    # (worker/kv_tier/copier.py `load_speed`): a little under a plain copy's (45 GB/s against
    # 55.2 on the H200, where loads of scattered slots ran 5-10% under a plain copy).
    load_speed_guess: float
    # Cached GPU blocks written back ahead of their eviction per step (~2.4 ms of copy: the
    # store stream is free again before the next step's stores, which the forward waits for),
    # and per batch while idle (a request arriving meanwhile finds its stores queued behind at
    # most that much). 128 MiB each on the H200.
    write_ahead_bytes: int
    idle_write_ahead_bytes: int

    @classmethod
    def derive(cls, copy_bytes_per_s: float) -> LinkTiming:
        """The values for a link that copies `copy_bytes_per_s` from host to device."""
        if not copy_bytes_per_s > 0:
            raise ValueError(f"a measured copy rate must be positive, got {copy_bytes_per_s}")
        scale = copy_bytes_per_s / REFERENCE_COPY_BYTES_PER_S
        return cls(load_speed_guess=45e9 * scale, write_ahead_bytes=round(128 * 2**20 * scale),
                   idle_write_ahead_bytes=round(128 * 2**20 * scale))
