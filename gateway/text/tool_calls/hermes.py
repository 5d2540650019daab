"""Hermes-style calls (vLLM's `hermes`: Hermes 2 Pro, Qwen2.5, Qwen3): a JSON object with the
function's name and arguments between tags, as many as the model wants, content around them.

    I'll check both.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
    <tool_call>
    {"name": "get_time", "arguments": {"zone": "CET"}}
    </tool_call>
"""

from __future__ import annotations

from enum import IntEnum

from spillway.gateway.text.tool_calls.json_call import JsonCallReader
from spillway.gateway.text.tool_calls.parser import Outcome, ToolParser

START = "<tool_call>"
END = "</tool_call>"


class _State(IntEnum):
    CONTENT = 0
    OPENING = 1  # after <tool_call>: whitespace, then the object
    CALL = 2
    CLOSING = 3  # after the object: whitespace, then </tool_call>
    SKIPPING = 4  # the rest of a committed call that went wrong


class HermesParser(ToolParser):
    def __init__(self, tools: list[dict]) -> None:
        super().__init__(tools)
        self._state = _State.CONTENT
        self._call = JsonCallReader()

    def _step(self, final: bool) -> bool:
        match self._state:
            case _State.CONTENT:
                if self._content_until((START,), final) is None:
                    return False
                self._begin_call()
                self._consume(len(START))
                self._state = _State.OPENING
            case _State.OPENING:
                self._skip_space()
                if not self._left() and not final:
                    return False
                if self._peek() == "{":
                    self._call = JsonCallReader()
                    self._state = _State.CALL
                else:
                    self._reject()
                    self._state = _State.CONTENT
            case _State.CALL:
                outcome = self._read_call(self._call, final)
                if outcome == Outcome.WAITING:
                    return False
                self._state = {Outcome.ENDED: _State.CLOSING, Outcome.REJECTED: _State.CONTENT,
                               Outcome.BROKEN: _State.SKIPPING}[outcome]
            case _State.CLOSING:
                self._skip_space()
                at_end = self._at(END, final)
                if at_end is None:
                    return False
                if at_end:
                    self._consume(len(END))
                    self._state = _State.CONTENT
                else:
                    self._state = _State.CONTENT if not self._left() else _State.SKIPPING
            case _State.SKIPPING:
                # Up to the end tag, or a next call if the model never closed this one.
                marker = self._drop_until((END, START), final)
                if marker is None:
                    return False
                if marker == END:
                    self._consume(len(END))
                self._state = _State.CONTENT
        return True
