"""Mistral calls (vLLM's `mistral`), after the [TOOL_CALLS] marker in one of two forms:

    [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {...}]
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}

The first is the older tokenizers' (up to v7: Mistral 7B v0.3, Mixtral 8x22B, Nemo), the second
the newer ones' (v11 and later: Mistral Small 3.x, Devstral, Magistral), which may also write a
[CALL_ID]id before [ARGS], or drop [ARGS] when the text is decoded without special tokens. A
model-written call id is not used. Mistral's chat format requires call ids of 9 letters and
digits, so these calls get such ids.
"""

from __future__ import annotations

from enum import IntEnum

from spillway.gateway.text.tool_calls.calls import new_mistral_call_id
from spillway.gateway.text.tool_calls.json_call import JsonArgumentsReader, JsonCallReader
from spillway.gateway.text.tool_calls.parser import MAX_NAME_CHARS, Outcome, ToolParser

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"
CALL_ID = "[CALL_ID]"
_NAME_ENDS = frozenset(" \t\r\n[{")


class _State(IntEnum):
    CONTENT = 0
    OPENING = 1  # after [TOOL_CALLS]: a list, or a name
    ITEM = 2  # in the list: whitespace, then a call object
    ITEM_CALL = 3
    ITEM_NEXT = 4  # after a call object: "," or "]"
    NAME = 5
    AFTER_NAME = 6  # [CALL_ID]..., [ARGS], or the arguments themselves
    CALL_ID = 7
    ARGUMENTS_OPENING = 8  # after [ARGS]: whitespace, then "{"
    ARGUMENTS = 9
    SKIPPING = 10  # the rest of a committed call that went wrong


class MistralParser(ToolParser):
    call_id = staticmethod(new_mistral_call_id)

    def __init__(self, tools: list[dict]) -> None:
        super().__init__(tools)
        self._state = _State.CONTENT
        self._call: JsonCallReader | JsonArgumentsReader = JsonCallReader()
        self._name = ""

    def _step(self, final: bool) -> bool:
        state = self._state
        if state == _State.CONTENT:
            if self._content_until((TOOL_CALLS,), final) is None:
                return False
            self._begin_call()
            self._consume(len(TOOL_CALLS))
            self._state = _State.OPENING
        elif state == _State.SKIPPING:
            if self._drop_until((TOOL_CALLS,), final) is None:
                return False
            self._state = _State.CONTENT
        elif state in (_State.ITEM_CALL, _State.ARGUMENTS):
            return self._read_step(final)
        elif state in (_State.NAME, _State.CALL_ID):
            return self._name_step(final)
        else:
            self._skip_space()
            if not self._left() and not final:
                return False
            return self._punctuation_step(final)
        return True

    def _punctuation_step(self, final: bool) -> bool:
        """The states that look at the next character after whitespace; False to wait."""
        char = self._peek()
        match self._state:
            case _State.OPENING:
                if char == "[":
                    self._consume(1)
                    self._state = _State.ITEM
                elif char and char not in _NAME_ENDS:
                    self._state = _State.NAME
                else:
                    self._reject_to_content()
            case _State.ITEM:
                if char == "{":
                    self._call = JsonCallReader()
                    self._state = _State.ITEM_CALL
                else:
                    self._reject_to_content()
            case _State.ITEM_NEXT:
                if char == ",":
                    self._consume(1)
                    self._state = _State.ITEM
                elif char == "]":
                    self._raw = None
                    self._consume(1)
                    self._state = _State.CONTENT
                else:
                    self._reject_to_content()
            case _State.AFTER_NAME | _State.ARGUMENTS_OPENING:
                if char == "{":
                    self._open_call(self._name)
                    self._call = JsonArgumentsReader()
                    self._state = _State.ARGUMENTS
                    return True
                if self._state == _State.AFTER_NAME:
                    waiting = False
                    for marker, state in ((ARGS, _State.ARGUMENTS_OPENING), (CALL_ID, _State.CALL_ID)):
                        at_marker = self._at(marker, final)
                        if at_marker:
                            self._consume(len(marker))
                            self._state = state
                            return True
                        waiting = waiting or at_marker is None
                    if waiting:
                        return False
                self._reject_to_content()
        return True

    def _name_step(self, final: bool) -> bool:
        """Reads a function name (up to whitespace, "[" or "{") or a [CALL_ID]'s id (letters and digits)."""
        end = self._pos
        if self._state == _State.NAME:
            while end < len(self._text) and self._text[end] not in _NAME_ENDS:
                end += 1
        else:
            while end < len(self._text) and self._text[end].isalnum():
                end += 1
        if end - self._pos > MAX_NAME_CHARS:
            self._reject_to_content()
            return True
        if end == len(self._text) and not final:
            return False
        taken = self._consume(end - self._pos)
        if self._state == _State.NAME:
            self._name = taken
        self._state = _State.AFTER_NAME
        return True

    def _read_step(self, final: bool) -> bool:
        outcome = self._read_call(self._call, final)
        if outcome == Outcome.WAITING:
            return False
        if outcome == Outcome.ENDED and self._state == _State.ITEM_CALL:
            self._begin_call()  # what follows in the list belongs to the next call
            self._state = _State.ITEM_NEXT
        else:
            self._state = {Outcome.ENDED: _State.CONTENT, Outcome.REJECTED: _State.CONTENT,
                           Outcome.BROKEN: _State.SKIPPING}[outcome]
        return True

    def _reject_to_content(self) -> None:
        self._reject()
        self._state = _State.CONTENT
