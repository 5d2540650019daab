"""The worker's heap trimming: at most once an interval while busy, at once on going idle."""

from __future__ import annotations

from spillway.worker.heap import HeapTrimmer, _glibc_malloc_trim


def test_trims_once_an_interval_while_busy_and_whenever_the_worker_goes_idle():
    now, trims = [100.0], []
    trimmer = HeapTrimmer(30.0, trim=lambda: trims.append(now[0]), clock=lambda: now[0])
    for t in (101.0, 120.0, 129.9):
        now[0] = t
        assert not trimmer.maybe_trim(went_idle=False)
    now[0] = 130.0
    assert trimmer.maybe_trim(went_idle=False)
    now[0] = 131.0
    assert trimmer.maybe_trim(went_idle=True)  # idle: at once, whatever the interval
    now[0] = 150.0
    assert not trimmer.maybe_trim(went_idle=False)
    assert trims == [130.0, 131.0]


def test_glibc_malloc_trim_is_found_and_runs():
    trim = _glibc_malloc_trim()
    assert trim is not None
    trim()
    assert HeapTrimmer(0.0).maybe_trim(went_idle=False)
