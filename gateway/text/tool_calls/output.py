"""What a tool-call parser has released to the client so far: content and call deltas."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from spillway.gateway.text.tool_calls.calls import ToolCallDelta


@dataclass(slots=True)
class StreamOutput:
    """Collects a parser's content and call deltas until the caller takes them.

    Content is released in segments: the text before the first call, between two calls, after
    the last. A segment that is only whitespace (the newlines a model writes around its calls)
    is no content at all, so a segment's leading whitespace is held until text shows; the rest
    of a segment is released as it comes.
    """

    new_call_id: Callable[[], str]
    num_calls: int = 0
    _content: list[str] = field(default_factory=list)
    _deltas: list[ToolCallDelta] = field(default_factory=list)
    _space: str = ""  # the current segment's whitespace, while it has shown nothing else
    _segment_shown: bool = False

    def write_content(self, text: str) -> None:
        if not text:
            return
        if not self._segment_shown:
            if text.isspace():
                self._space += text
                return
            text, self._space, self._segment_shown = self._space + text, "", True
        self._content.append(text)

    def open_call(self, name: str) -> None:
        """Starts the next call; the content segment before it ends here."""
        self._space, self._segment_shown = "", False
        self._deltas.append(ToolCallDelta(self.num_calls, self.new_call_id(), name, ""))
        self.num_calls += 1

    def write_arguments(self, text: str) -> None:
        """Appends to the arguments of the call opened last."""
        assert self.num_calls, "arguments belong to an opened call"
        if not text:
            return
        index = self.num_calls - 1
        last = self._deltas[-1] if self._deltas else None
        if last is not None and last.index == index and last.name is None:
            self._deltas[-1] = ToolCallDelta(index, arguments=last.arguments + text)
        else:
            self._deltas.append(ToolCallDelta(index, arguments=text))

    def end(self) -> None:
        """The output is over: a whitespace-only last segment is dropped."""
        self._space = ""

    def take(self) -> tuple[str, list[ToolCallDelta]]:
        content, deltas = "".join(self._content), self._deltas
        self._content, self._deltas = [], []
        return content, deltas
