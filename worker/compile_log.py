"""Kernels compiled after start-up, named in the log.

Start-up compiles every kernel variant the warm-up step and the captured graphs use. A shape
that reaches a variant nobody compiled yet (Triton specialises integer arguments and the
constexprs chosen from shapes) compiles inside the step that needs it: hundreds of
milliseconds to seconds during which every request waits. Triton calls its cache hook on
each in-process cache miss, before it compiles or reads its disk cache; logging there names
the variant, so a stall seen by clients can be matched to it."""

from __future__ import annotations

import logging
import time

logger = logging.getLogger("spillway.worker")


def log_late_compiles() -> bool:
    """From now on, log each kernel variant this process compiles. False where this Triton has
    no cache hook (then nothing is logged)."""
    try:
        from triton import knobs
    except ImportError:
        return False
    runtime = getattr(knobs, "runtime", None)
    if runtime is None or not hasattr(runtime, "jit_cache_hook"):
        return False
    previous = runtime.jit_cache_hook
    started = time.monotonic()

    def hook(*args, **kwargs):
        name = (kwargs.get("repr") or "a kernel").split("[")[0]
        logger.warning("compiling %s %.1f s after start-up (specialisation %s): the step that needs it waits for it",
                       name, time.monotonic() - started, str(kwargs.get("key"))[:600])
        return previous(*args, **kwargs) if previous is not None else None

    runtime.jit_cache_hook = hook
    return True
