"""The streaming skeleton every tool-call format shares: unread text, marker hold-back, and
handing a call that turned out malformed back as content.

A format is a state machine over the text not yet read (`_step`, one move at a time). `parse` runs the same
machine over a whole output, so a stream's content and calls always join to what `parse`
returns, however the text was cut.

Raw text: from the moment a call may begin (its start marker) until it is committed (its
name and the start of its arguments are known and sent), every character read is kept. A call
that proves malformed before that point is released as content, markers and all, and reading
goes on after it as ordinary content.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from enum import IntEnum
from typing import Protocol

from spillway.gateway.text.tool_calls.calls import ToolCall, ToolCallDelta, calls_from_deltas, new_call_id
from spillway.gateway.text.tool_calls.output import StreamOutput

MAX_NAME_CHARS = 256  # a function or parameter name longer than this is not one


class Outcome(IntEnum):
    WAITING = 0  # needs more text
    ENDED = 1  # the call is complete (or was cut short by the end of the output, and closed)
    REJECTED = 2  # malformed before it was committed: its text is back in the content
    BROKEN = 3  # malformed after it was committed: the call stands with what was read


class CallReader(Protocol):
    committed: bool
    failed: bool

    @property
    def done(self) -> bool: ...

    def read(self, text: str, pos: int, out: StreamOutput) -> int: ...

    def finish(self, out: StreamOutput) -> None: ...


class ToolParser(ABC):
    """Splits a model's output into content and tool calls, whole (`parse`) or as it streams
    (`feed` each new piece of text, then `finish`). Never raises on malformed text."""

    call_id = staticmethod(new_call_id)

    def __init__(self, tools: list[dict]) -> None:
        self.tools = tools
        self._out = StreamOutput(self.call_id)
        self._text = ""  # received text; everything before _pos is read
        self._pos = 0
        self._raw: list[str] | None = None  # the read text of a call not yet committed

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The whole output's content (None when there is none) and its calls."""
        parser = type(self)(self.tools)
        content, deltas = parser.feed(text)
        tail, more_deltas = parser.finish()
        content += tail
        return (content if content.strip() else None), calls_from_deltas(deltas + more_deltas)

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """The next piece of output; returns the content and call deltas it releases."""
        self._text = self._text[self._pos:] + text
        self._pos = 0
        self._advance(final=False)
        return self._out.take()

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """The output is over: releases everything still held."""
        self._advance(final=True)
        self._out.end()
        return self._out.take()

    def _advance(self, final: bool) -> None:
        """Reads as far as the text allows; with `final`, to its end."""
        while self._step(final):
            pass

    @abstractmethod
    def _step(self, final: bool) -> bool:
        """One move of the format's machine; False when it must wait for more text (or, with
        `final`, is through)."""

    # Reading the unread text.

    def _left(self) -> int:
        return len(self._text) - self._pos

    def _peek(self) -> str:
        return self._text[self._pos] if self._pos < len(self._text) else ""

    def _consume(self, count: int) -> str:
        taken = self._text[self._pos:self._pos + count]
        self._pos += count
        if self._raw is not None and taken:
            self._raw.append(taken)
        return taken

    def _skip_space(self) -> None:
        end = self._pos
        while end < len(self._text) and self._text[end].isspace():
            end += 1
        self._consume(end - self._pos)

    def _at(self, marker: str, final: bool) -> bool | None:
        """Whether the unread text starts with `marker`; None while it is a shorter prefix of it."""
        if self._text.startswith(marker, self._pos):
            return True
        if final or self._left() >= len(marker):
            return False
        return None if marker.startswith(self._text[self._pos:]) else False

    def _find(self, markers: tuple[str, ...]) -> tuple[int, str] | None:
        """The first marker in the unread text and where it starts."""
        found = None
        for marker in markers:
            at = self._text.find(marker, self._pos)
            if at >= 0 and (found is None or at < found[0]):
                found = (at, marker)
        return found

    def _until(self, markers: tuple[str, ...], final: bool) -> tuple[int, str | None]:
        """How far the unread text may be taken before a marker: up to the first of `markers`
        (returned with it), else to the end less a tail that may begin one (all, with `final`)."""
        found = self._find(markers)
        if found is not None:
            return found
        if final:
            return len(self._text), None
        return len(self._text) - _marker_prefix_len(self._text, self._pos, markers), None

    def _pass_until(self, markers: tuple[str, ...], final: bool, keep: bool) -> str | None:
        """Consumes text up to the first of `markers` (which stays unread), releasing it as
        content with `keep` or dropping it; returns the marker, or None when none is there yet."""
        end, marker = self._until(markers, final)
        passed = self._consume(end - self._pos)
        if keep:
            self._out.write_content(passed)
        return marker

    def _content_until(self, markers: tuple[str, ...], final: bool) -> str | None:
        return self._pass_until(markers, final, keep=True)

    def _drop_until(self, markers: tuple[str, ...], final: bool) -> str | None:
        return self._pass_until(markers, final, keep=False)

    # Calls.

    def _begin_call(self) -> None:
        """A call may begin here: keep what is read from now on in case it is malformed."""
        self._raw = []

    def _reject(self) -> None:
        """The call begun is malformed: what was read of it is content after all."""
        raw, self._raw = self._raw or [], None
        self._out.write_content("".join(raw))

    def _open_call(self, name: str) -> None:
        self._raw = None
        self._out.open_call(name)

    def _read_call(self, reader: CallReader, final: bool) -> Outcome:
        end = reader.read(self._text, self._pos, self._out)
        self._consume(end - self._pos)
        if reader.committed:
            self._raw = None
        if reader.failed:
            if reader.committed:
                return Outcome.BROKEN
            self._reject()
            return Outcome.REJECTED
        if reader.done:
            return Outcome.ENDED
        if not final:
            return Outcome.WAITING
        if reader.committed:
            reader.finish(self._out)
            return Outcome.ENDED
        self._reject()
        return Outcome.REJECTED


def _marker_prefix_len(text: str, start: int, markers: tuple[str, ...]) -> int:
    """Length of the longest tail of text[start:] that is a proper prefix of a marker."""
    longest = min(max(len(marker) for marker in markers) - 1, len(text) - start)
    for length in range(longest, 0, -1):
        tail = text[len(text) - length:]
        if any(marker.startswith(tail) for marker in markers):
            return length
    return 0
