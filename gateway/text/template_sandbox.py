"""Requests' own chat templates rendered in a child process, within bounds on memory, time
and output (`spillway serve --trust-request-chat-template`).

A chat template is a program. Jinja's sandbox keeps it from the host's objects but not from its
resources: `{{ "x" * 10**11 }}`, a loop that doubles a `namespace()` string, or nested loops
that print nothing run for as long, and take as much memory, as they like, and rendering in the
gateway would hold the event loop and then the process. So a request's template goes to one
persistent child, `python -m spillway.gateway.text.template_renderer`, whose address space is capped
by an rlimit (a template that outgrows it gets a MemoryError there, or the child dies); the
gateway waits at most `timeout_s` for the answer, killing and restarting the child past it, and
reads back at most a frame of the output bound (4 bytes of UTF-8 per character). The gateway's
own memory for one render is thus the request and that frame.

    gateway thread ── RenderTemplate ──▶ child (RLIMIT_AS) ── Rendered | RenderFailed ──▶
                      length-prefixed msgpack frames over the child's stdin and stdout

The operator's template (--chat-template, the model's) renders in-process: it is trusted code,
and its output grows only with the request body, which is bounded.
"""

from __future__ import annotations

import logging
import os
import select
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import msgspec

logger = logging.getLogger("spillway.gateway")

FRAME_HEADER = struct.Struct("<I")
STARTUP_TIMEOUT_S = 120.0  # the child imports transformers' template module (~1 s; more on a loaded host)
FRAME_SLACK_BYTES = 4096  # a reply's fields beside its text
DEFAULT_TIMEOUT_S = 2.0
DEFAULT_MEMORY_MIB = 1024
MIN_MEMORY_MIB = 256  # the child's modules alone take ~200 MiB of address space


@dataclass(frozen=True, slots=True)
class TemplateLimits:
    """How far one rendering of a request's chat template may go."""

    timeout_s: float = DEFAULT_TIMEOUT_S  # wall time of one rendering
    memory_mib: int = DEFAULT_MEMORY_MIB  # the child's whole address space, its ~200 MiB of modules included

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:  # NaN too
            raise ValueError(f"--request-chat-template-timeout must be a positive number of seconds, "
                             f"got {self.timeout_s}")
        if self.memory_mib < MIN_MEMORY_MIB:
            raise ValueError(f"--request-chat-template-memory-mb must be at least {MIN_MEMORY_MIB} (the renderer's "
                             f"modules take ~200 MiB), got {self.memory_mib}")


class TemplateLimitExceeded(Exception):
    """A request's template went past a bound (time, memory, output): the request's fault, a 400."""


# ---- the wire between gateway and child -------------------------------------------------------


class RenderTemplate(msgspec.Struct, tag=True, frozen=True):
    template: str
    messages: list[dict[str, Any]]
    add_generation_prompt: bool
    continue_final_message: bool
    documents: list[dict[str, str]] | None
    variables: dict[str, Any]  # the tokenizer's special tokens, then chat_template_kwargs
    max_chars: int


class RendererReady(msgspec.Struct, tag=True, frozen=True):
    pass


class Rendered(msgspec.Struct, tag=True, frozen=True):
    text: str


class RenderFailed(msgspec.Struct, tag=True, frozen=True):
    message: str
    past_limit: bool  # memory or output bound, else the template's own error


Reply = RendererReady | Rendered | RenderFailed


def frame(payload: bytes) -> bytes:
    return FRAME_HEADER.pack(len(payload)) + payload


class _ReadFailed(Exception):
    """The child did not answer in time, sent a frame over the bound, or ended."""


# ---- the gateway's side -----------------------------------------------------------------------


class TemplateSandbox:
    """The child that renders requests' templates; one rendering at a time, callable from any thread."""

    def __init__(self, limits: TemplateLimits) -> None:
        self.limits = limits
        self._lock = threading.Lock()
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(Reply)
        self._process: subprocess.Popen | None = None
        self._ready = False
        self._start()

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def render(self, template: str, messages: list[dict], *, add_generation_prompt: bool,
               continue_final_message: bool, documents: list[dict] | None, variables: dict,
               max_chars: int) -> str:
        """The rendered text; ValueError for the template's own errors, TemplateLimitExceeded past a bound."""
        try:
            request = frame(self._encoder.encode(RenderTemplate(
                template, messages, add_generation_prompt, continue_final_message, documents, variables, max_chars)))
        except OverflowError as exc:  # JSON's integers have no bound, msgpack's 64 bits
            raise ValueError(f"cannot apply the chat template: a template variable {exc}") from None
        with self._lock:
            self._wait_ready()
            try:
                self._process.stdin.write(request)
                self._process.stdin.flush()
                reply = self._read(self.limits.timeout_s, 4 * max_chars + FRAME_SLACK_BYTES)
            except (_ReadFailed, OSError) as exc:
                self._restart()
                raise TemplateLimitExceeded(f"the request's chat template was stopped: {exc}") from None
        match reply:
            case Rendered(text=text) if len(text) <= max_chars:
                return text
            case Rendered():
                raise TemplateLimitExceeded(f"the request's chat template rendered more than {max_chars} characters")
            case RenderFailed(message=message, past_limit=True):
                raise TemplateLimitExceeded(f"the request's chat template was stopped: {message}")
            case RenderFailed(message=message):
                raise ValueError(f"cannot apply the chat template: {message}")
            case _:
                raise RuntimeError(f"the template renderer sent {reply!r} in answer to a rendering")

    def close(self) -> None:
        with self._lock:
            self._stop()

    def _start(self) -> None:
        # One thread each for the BLAS pools numpy starts on import: their stacks would count
        # against the address-space limit, a different amount on every host.
        env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        self._process = subprocess.Popen(
            [sys.executable, "-m", "spillway.gateway.text.template_renderer", str(self.limits.memory_mib << 20)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        self._ready = False

    def _stop(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.wait()
            for pipe in (self._process.stdin, self._process.stdout):
                pipe.close()
            self._process = None

    def _restart(self) -> None:
        logger.warning("restarting the template renderer after a request's chat template went past its bounds")
        self._stop()
        self._start()

    def _wait_ready(self) -> None:
        if self._process is None:
            self._start()
        if self._ready:
            return
        try:
            reply = self._read(STARTUP_TIMEOUT_S, FRAME_SLACK_BYTES)
        except _ReadFailed as exc:
            self._stop()
            raise RuntimeError(f"the template renderer did not start: {exc}") from None
        if not isinstance(reply, RendererReady):
            self._stop()
            raise RuntimeError(f"the template renderer started with {reply!r}")
        self._ready = True

    def _read(self, timeout_s: float, max_bytes: int) -> Reply:
        """One frame from the child, whole within `timeout_s`, of at most `max_bytes`."""
        deadline = time.monotonic() + timeout_s
        header = self._read_exactly(FRAME_HEADER.size, deadline, timeout_s)
        (length,) = FRAME_HEADER.unpack(header)
        if length > max_bytes:
            raise _ReadFailed(f"its output went past the bound ({length} bytes, at most {max_bytes})")
        return self._decoder.decode(self._read_exactly(length, deadline, timeout_s))

    def _read_exactly(self, size: int, deadline: float, timeout_s: float) -> bytes:
        fd = self._process.stdout.fileno()
        chunks, received = [], 0
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        while received < size:
            left = deadline - time.monotonic()
            if left <= 0 or not poller.poll(left * 1000):
                raise _ReadFailed(f"it took longer than {timeout_s:g} s")
            chunk = os.read(fd, min(size - received, 1 << 20))
            if not chunk:
                raise _ReadFailed(f"the renderer ended (its memory limit is {self.limits.memory_mib} MiB)")
            chunks.append(chunk)
            received += len(chunk)
        return b"".join(chunks)
