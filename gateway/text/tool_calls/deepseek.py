"""DeepSeek calls (vLLM's `deepseek_v3` and `deepseek_v31`), framed by the model's special
tokens, which are written with full-width bars and U+2581 (▁) for spaces:

    deepseek_v3 (V3, R1-0528):
    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

    deepseek_v31 (V3.1), all on one line:
    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}
    <｜tool▁call▁end｜><｜tool▁calls▁end｜>

Several calls follow one another inside one calls-begin/calls-end section. Content comes
before the section (and, if the model writes any, after it). The code fence of V3 is accepted
but not required.
"""

from __future__ import annotations

from enum import IntEnum

from spillway.gateway.text.tool_calls.json_call import JsonArgumentsReader
from spillway.gateway.text.tool_calls.parser import MAX_NAME_CHARS, Outcome, ToolParser

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"
FENCE = "```"


class _State(IntEnum):
    CONTENT = 0
    SECTION = 1  # between calls: whitespace, then a call or the section's end
    HEAD = 2  # V3: the call's type up to <｜tool▁sep｜>; V3.1: its name
    NAME = 3  # V3: the name's line
    FENCE = 4  # V3: an optional ```json line
    FENCE_LANGUAGE = 5
    OPENING = 6  # whitespace, then the arguments' "{"
    ARGUMENTS = 7
    CLOSING = 8  # optional ```, then <｜tool▁call▁end｜>
    SKIPPING = 9  # the rest of a committed call that went wrong


class DeepSeekV3Parser(ToolParser):
    name_before_separator = False  # V3 writes a type ("function") there, and the name after it

    def __init__(self, tools: list[dict]) -> None:
        super().__init__(tools)
        self._state = _State.CONTENT
        self._arguments = JsonArgumentsReader()
        self._name = ""

    def _step(self, final: bool) -> bool:
        match self._state:
            case _State.CONTENT:
                marker = self._content_until((CALLS_BEGIN, CALL_BEGIN), final)
                if marker is None:
                    return False
                self._begin_call()
                self._consume(len(marker))
                self._state = _State.SECTION if marker == CALLS_BEGIN else _State.HEAD
            case _State.SECTION:
                return self._section_step(final)
            case _State.HEAD | _State.NAME:
                return self._head_step(final)
            case _State.FENCE:
                self._skip_space()
                at_fence = self._at(FENCE, final)
                if at_fence is None:
                    return False
                if at_fence:
                    self._consume(len(FENCE))
                self._state = _State.FENCE_LANGUAGE if at_fence else _State.OPENING
            case _State.FENCE_LANGUAGE:
                end = self._pos
                while end < len(self._text) and self._text[end].isalpha():
                    end += 1
                self._consume(end - self._pos)
                if end == len(self._text) and not final:
                    return False
                self._state = _State.OPENING
            case _State.OPENING:
                self._skip_space()
                if not self._left() and not final:
                    return False
                if self._peek() == "{":
                    self._open_call(self._name)
                    self._arguments = JsonArgumentsReader()
                    self._state = _State.ARGUMENTS
                else:
                    self._reject()
                    self._state = _State.CONTENT
            case _State.ARGUMENTS:
                outcome = self._read_call(self._arguments, final)
                if outcome == Outcome.WAITING:
                    return False
                self._state = _State.CLOSING if outcome == Outcome.ENDED else _State.SKIPPING
            case _State.CLOSING:
                return self._closing_step(final)
            case _State.SKIPPING:
                marker = self._drop_until((CALL_END, CALL_BEGIN, CALLS_END), final)
                if marker is None:
                    return False
                if marker == CALL_END:
                    self._consume(len(CALL_END))
                self._begin_call()
                self._state = _State.SECTION
        return True

    def _section_step(self, final: bool) -> bool:
        self._skip_space()
        for marker, state in ((CALL_BEGIN, _State.HEAD), (CALLS_END, _State.CONTENT)):
            at_marker = self._at(marker, final)
            if at_marker is None:
                return False
            if at_marker:
                self._consume(len(marker))
                if state == _State.CONTENT:
                    self._raw = None  # the section's end and the whitespace before it are no content
                self._state = state
                return True
        self._reject()  # text in the section that is no call, or the output ended there
        self._state = _State.CONTENT
        return True

    def _head_step(self, final: bool) -> bool:
        """Reads the text up to <｜tool▁sep｜> (HEAD) or the end of the line (V3's NAME)."""
        ending = SEP if self._state == _State.HEAD else "\n"
        end = self._text.find(ending, self._pos)
        limit = self._pos + MAX_NAME_CHARS
        if end < 0 and len(self._text) <= limit and "\n" not in self._text[self._pos:] and not final:
            return False
        head = self._text[self._pos:end].strip() if 0 <= end <= limit else ""
        if not head or "\n" in head or "<｜" in head:
            self._reject()
            self._state = _State.CONTENT
            return True
        self._consume(end + len(ending) - self._pos)
        if self._state == _State.NAME or self.name_before_separator:
            self._name = head
            self._state = _State.OPENING if self.name_before_separator else _State.FENCE
        else:
            self._state = _State.NAME
        return True

    def _closing_step(self, final: bool) -> bool:
        self._skip_space()
        at_fence = self._at(FENCE, final)
        if at_fence is None:
            return False
        if at_fence:
            self._consume(len(FENCE))
            self._skip_space()
        at_end = self._at(CALL_END, final)
        if at_end is None:
            return False
        if at_end:
            self._consume(len(CALL_END))
            self._begin_call()  # what follows is the section's next call, or content
            self._state = _State.SECTION
        else:
            self._state = _State.CONTENT if not self._left() else _State.SKIPPING
        return True


class DeepSeekV31Parser(DeepSeekV3Parser):
    name_before_separator = True
