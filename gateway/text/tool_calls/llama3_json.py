"""Llama 3.1/3.2 JSON calls (vLLM's `llama3_json`): the output is one or more call objects
separated by semicolons, with the arguments under "parameters" (or "arguments").

    {"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}

A call begins where the output begins with "{" (after any whitespace), or after the
<|python_tag|> marker, which is how content can come before calls. A "{" anywhere else is
content: answers that merely contain JSON stay answers. An object that is not a call (no
"name" string) is released as content once it ends.
"""

from __future__ import annotations

from enum import IntEnum

from spillway.gateway.text.tool_calls.json_call import JsonCallReader
from spillway.gateway.text.tool_calls.parser import Outcome, ToolParser

PYTHON_TAG = "<|python_tag|>"
ARGUMENT_KEYS = ("parameters", "arguments")


class _State(IntEnum):
    START = 0  # the output's leading whitespace, then "{" or content
    CONTENT = 1
    OPENING = 2  # after <|python_tag|>: whitespace, then "{"
    CALL = 3
    SEPARATOR = 4  # after a call: whitespace, then ";" or the next "{"
    NEXT = 5  # after ";": whitespace, then "{"
    SKIPPING = 6  # the rest of a committed call that went wrong


class Llama3JsonParser(ToolParser):
    def __init__(self, tools: list[dict]) -> None:
        super().__init__(tools)
        self._state = _State.START
        self._call = JsonCallReader(ARGUMENT_KEYS)

    def _step(self, final: bool) -> bool:
        match self._state:
            case _State.START:
                start = self._pos
                self._skip_space()
                self._out.write_content(self._text[start:self._pos])
                if not self._left():
                    return False
                if self._peek() == "{":
                    self._begin_call()
                    self._start_call()
                else:
                    self._state = _State.CONTENT
            case _State.CONTENT:
                if self._content_until((PYTHON_TAG,), final) is None:
                    return False
                self._begin_call()
                self._consume(len(PYTHON_TAG))
                self._state = _State.OPENING
            case _State.OPENING | _State.NEXT:
                self._skip_space()
                if not self._left() and not final:
                    return False
                if not self._left() and self._state == _State.NEXT:
                    self._raw = None  # a dangling last ";" is no content
                    self._state = _State.CONTENT
                elif self._peek() == "{":
                    self._start_call()
                else:
                    self._reject()
                    self._state = _State.CONTENT
            case _State.CALL:
                outcome = self._read_call(self._call, final)
                if outcome == Outcome.WAITING:
                    return False
                if outcome == Outcome.ENDED:
                    self._begin_call()  # the separator is the next call's, or content
                self._state = {Outcome.ENDED: _State.SEPARATOR, Outcome.REJECTED: _State.CONTENT,
                               Outcome.BROKEN: _State.SKIPPING}[outcome]
            case _State.SEPARATOR:
                self._skip_space()
                if not self._left() and not final:
                    return False
                if self._peek() == ";":
                    self._consume(1)
                    self._state = _State.NEXT
                elif self._peek() == "{":
                    self._start_call()
                else:
                    self._reject()
                    self._state = _State.CONTENT
            case _State.SKIPPING:
                if self._drop_until((PYTHON_TAG,), final) is None:
                    return False
                self._state = _State.CONTENT
        return True

    def _start_call(self) -> None:
        self._call = JsonCallReader(ARGUMENT_KEYS)
        self._state = _State.CALL
