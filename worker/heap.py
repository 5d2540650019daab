"""Giving the worker's freed heap back to the operating system.

On the CPU the linear layers' oneDNN kernels are built per input shape and evicted from
bounded caches (worker/models/cpu_linear.py); their memory is freed into glibc's heap, where
it stays, fragmented, counted in the process's RSS. `malloc_trim` returns the free pages.
It costs a few milliseconds on a heap of a few hundred megabytes, so the busy loop asks for it
at most once every `interval_s` (and at once when the worker goes idle). A no-op where the C
library has no `malloc_trim` (not glibc).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import time
from collections.abc import Callable


def _glibc_malloc_trim() -> Callable[[], None] | None:
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None
    if trim is None:
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return lambda: trim(0)


class HeapTrimmer:
    def __init__(self, interval_s: float = 30.0, trim: Callable[[], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self._trim = trim if trim is not None else _glibc_malloc_trim()
        self._clock = clock
        self._last = clock()

    def maybe_trim(self, went_idle: bool) -> bool:
        """Trim when the worker just went idle or `interval_s` passed since the last trim;
        whether it did."""
        now = self._clock()
        if self._trim is None or not (went_idle or now - self._last >= self.interval_s):
            return False
        self._trim()
        self._last = now
        return True
