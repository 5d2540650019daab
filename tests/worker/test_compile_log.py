"""A kernel variant compiled after start-up is named in the worker's log."""

from __future__ import annotations

import logging

import pytest

from spillway.worker.compile_log import log_late_compiles

knobs = pytest.importorskip("triton").knobs


def test_a_late_compile_is_logged_and_the_compile_still_happens(caplog):
    before = knobs.runtime.jit_cache_hook
    try:
        assert log_late_compiles()
        with caplog.at_level(logging.WARNING, logger="spillway.worker"):
            skip = knobs.runtime.jit_cache_hook(key="k", repr="_prefill_kernel[num_warps=4](q_ptr: *bf16)",
                                                fn=None, compile=None, is_manual_warmup=False,
                                                already_compiled=False)
        assert not skip  # a true value would make Triton skip the compile
        assert "compiling _prefill_kernel " in caplog.text and "specialisation k" in caplog.text
    finally:
        knobs.runtime.jit_cache_hook = before


def test_an_earlier_hook_keeps_being_called():
    calls = []
    before = knobs.runtime.jit_cache_hook
    try:
        knobs.runtime.jit_cache_hook = lambda **kwargs: calls.append(kwargs["repr"])
        log_late_compiles()
        knobs.runtime.jit_cache_hook(repr="kernel")
        assert calls == ["kernel"]
    finally:
        knobs.runtime.jit_cache_hook = before
