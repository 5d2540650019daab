"""A per-step trace of the worker's busy loop, for finding where latency goes
(`SPILLWAY_STEP_TRACE=FILE`, read in protocol/local/envs.py).

One JSON line per loop iteration that stepped the engine, times in milliseconds from the
first line:

    {"t": 12.31, "recv": 3, "step_ms": 4.02, "chunks": 5, "tokens": 20, "running": 5, "waiting": 0,
     "to_gpu_mb": 1440.0, "to_cpu_mb": 0.0, "deltas": 4, "firsts": 4, "early": false}

`recv`: Generate messages taken in before the step; `step_ms`: host time of `Engine.step`
(with asynchronous scheduling a step's device work ends in a later call); `chunks`/`tokens`:
the step's plan; `to_gpu_mb` / `to_cpu_mb`: tier copies queued so far (cumulative);
`firsts`: first tokens among the step's `deltas`; `early`: the step was planned before the loads
it waits for landed (worker/driver/tier_driver.py).
Off by default: it costs a few microseconds a step and a write.
"""

from __future__ import annotations

import json


class StepTrace:
    def __init__(self, path: str) -> None:
        self._file = open(path, "a", buffering=1)  # noqa: SIM115 (lives as long as the worker)
        self._start: float | None = None

    def record(self, started: float, ended: float, received: int, engine, deltas) -> None:
        if self._start is None:
            self._start = started
        copier = engine.executor.kv_copier
        plan = engine.last_plan
        self._file.write(json.dumps({
            "t": round((started - self._start) * 1e3, 3),
            "recv": received,
            "step_ms": round((ended - started) * 1e3, 3),
            "chunks": len(plan.chunks) if plan else 0,
            "tokens": plan.num_batched_tokens if plan else 0,
            "running": engine.scheduler.num_running,
            "waiting": engine.scheduler.num_waiting,
            "to_gpu_mb": round(copier.bytes_to_gpu / 1e6, 1) if copier else 0.0,
            "to_cpu_mb": round(copier.bytes_to_cpu / 1e6, 1) if copier else 0.0,
            "deltas": len(deltas),
            "firsts": sum(delta.num_cached_tokens >= 0 for delta in deltas),
            "early": bool(plan and plan.kv_copies.wait_for_loads),
        }) + "\n")
