"""Qwen3-Coder's XML-style calls (vLLM's `qwen3_coder`): the function and each parameter in
tags, the values as plain text, several functions if the model wants.

    I'll look.
    <tool_call>
    <function=read_file>
    <parameter=path>
    src/main.py
    </parameter>
    <parameter=max_lines>
    200
    </parameter>
    </function>
    </tool_call>

One newline after a parameter's opening tag and one before its closing tag are layout, not
value. A value becomes JSON by the parameter's type in the request's tool schema (see
parameter_values.py); string values, often whole files, stream as they come, the others go out
whole. A <function=...> block without the <tool_call> around it is read too, as vLLM does; a
parameter left open ends at the next tag.
"""

from __future__ import annotations

import json
from enum import IntEnum

from spillway.gateway.text.tool_calls.output import StreamOutput
from spillway.gateway.text.tool_calls.parameter_values import STRING_TYPES, json_value, parameter_types
from spillway.gateway.text.tool_calls.parser import MAX_NAME_CHARS, ToolParser

START = "<tool_call>"
END = "</tool_call>"
FUNCTION = "<function="
FUNCTION_END = "</function>"
PARAMETER = "<parameter="
PARAMETER_END = "</parameter>"
_VALUE_ENDS = (PARAMETER_END, PARAMETER, FUNCTION_END, END)


class _State(IntEnum):
    CONTENT = 0
    BLOCK = 1  # inside <tool_call>, between functions
    FUNCTION_NAME = 2
    PARAMETERS = 3  # inside a function, between parameters
    PARAMETER_NAME = 4
    VALUE = 5
    SKIPPING = 6  # text after a committed call that does not belong in the block


class Qwen3CoderParser(ToolParser):
    def __init__(self, tools: list[dict]) -> None:
        super().__init__(tools)
        self._types = parameter_types(tools)
        self._state = _State.CONTENT
        self._in_block = False  # the function was opened inside <tool_call>
        self._block_calls = 0
        self._function = ""
        self._num_parameters = 0
        self._value = _Value("", "string")

    def _step(self, final: bool) -> bool:
        match self._state:
            case _State.CONTENT:
                marker = self._content_until((START, FUNCTION), final)
                if marker is None:
                    return False
                self._begin_call()
                self._in_block, self._block_calls = marker == START, 0
                self._consume(len(marker))
                self._state = _State.BLOCK if marker == START else _State.FUNCTION_NAME
            case _State.BLOCK:
                return self._block_step(final)
            case _State.FUNCTION_NAME | _State.PARAMETER_NAME:
                return self._name_step(final)
            case _State.PARAMETERS:
                return self._parameters_step(final)
            case _State.VALUE:
                return self._value_step(final)
            case _State.SKIPPING:
                marker = self._drop_until((END, START, FUNCTION), final)
                if marker is None:
                    return False
                if marker == END:
                    self._consume(len(END))
                self._state = _State.CONTENT
        return True

    def _block_step(self, final: bool) -> bool:
        self._skip_space()
        for marker in (FUNCTION, END):
            at_marker = self._at(marker, final)
            if at_marker is None:
                return False
            if at_marker and marker == FUNCTION:
                if self._raw is None:
                    self._begin_call()  # a next function that may yet prove malformed
                self._consume(len(FUNCTION))
                self._state = _State.FUNCTION_NAME
                return True
            if at_marker:
                self._consume(len(END))
                self._end_block(junk=False)
                return True
        self._end_block(junk=bool(self._left()))
        return True

    def _end_block(self, junk: bool) -> None:
        """The block ends, at its end tag or at text that has no place in it (`junk`)."""
        if self._block_calls:
            self._raw = None
            self._state = _State.SKIPPING if junk else _State.CONTENT
        else:
            self._reject()  # a block with no function in it is no call
            self._state = _State.CONTENT

    def _name_step(self, final: bool) -> bool:
        """Reads a function or parameter name up to its ">"."""
        end = self._text.find(">", self._pos)
        if end < 0 and self._left() <= MAX_NAME_CHARS and "\n" not in self._text[self._pos:] and not final:
            return False
        written = self._text[self._pos:end] if 0 <= end <= self._pos + MAX_NAME_CHARS else ""
        name = written.strip()
        valid = bool(name) and "\n" not in written and "<" not in written
        if self._state == _State.FUNCTION_NAME:
            if not valid:
                self._reject()
                self._state = _State.CONTENT
                return True
            self._consume(end + 1 - self._pos)
            self._open_call(name)
            self._out.write_arguments("{")
            self._function, self._num_parameters = name, 0
            self._block_calls += 1
            self._state = _State.PARAMETERS
        elif valid:
            self._consume(end + 1 - self._pos)
            self._value = _Value(name, self._types.get(self._function, {}).get(name, "string"))
            self._state = _State.VALUE
        else:  # not a parameter after all: left for PARAMETERS to pass over
            self._state = _State.PARAMETERS
        return True

    def _parameters_step(self, final: bool) -> bool:
        self._skip_space()
        for marker in (PARAMETER, FUNCTION_END, END, FUNCTION):
            at_marker = self._at(marker, final)
            if at_marker is None:
                return False
            if at_marker:
                if marker in (PARAMETER, FUNCTION_END):
                    self._consume(len(marker))
                if marker == PARAMETER:
                    self._state = _State.PARAMETER_NAME
                else:
                    self._end_function(_State.BLOCK if self._in_block or marker != FUNCTION_END else _State.CONTENT)
                return True
        if not self._left():
            self._end_function(_State.CONTENT)  # the output ended inside the function
            return True
        # Stray text between parameters: passed over up to the next tag.
        next_tag = self._text.find("<", self._pos + 1)
        self._consume((next_tag if next_tag >= 0 else len(self._text)) - self._pos)
        return True

    def _value_step(self, final: bool) -> bool:
        end, marker = self._until(_VALUE_ENDS, final)
        self._value.add(self._consume(end - self._pos), self._out, self._num_parameters)
        if marker is None and not final:
            return False
        if marker == PARAMETER_END:
            self._consume(len(PARAMETER_END))
        self._value.end(self._out, self._num_parameters)
        self._num_parameters += 1
        self._state = _State.PARAMETERS
        return True

    def _end_function(self, state: _State) -> None:
        self._out.write_arguments("}")
        self._state = state


class _Value:
    """One parameter's value as its text arrives. A string value streams, holding back only
    what may yet be layout (a trailing newline) or the text "null" (which means null); any
    other type is converted once the value is whole."""

    __slots__ = ("name", "type_name", "_parts", "_pending", "_started", "_opened")

    def __init__(self, name: str, type_name: str) -> None:
        self.name = name
        self.type_name = type_name
        self._parts: list[str] = []
        self._pending = ""
        self._started = False  # the value's first character has been seen
        self._opened = False  # the member's key and opening quote are written

    def add(self, text: str, out: StreamOutput, position: int) -> None:
        if not text:
            return
        if self.type_name not in STRING_TYPES:
            self._parts.append(text)
            return
        pending = self._pending + text
        if not self._started:
            self._started = True
            pending = pending.removeprefix("\n")
        if not self._opened:
            candidate = pending.removesuffix("\n")
            if len(candidate) <= 4 and "null".startswith(candidate.lower()):
                self._pending = pending
                return
            out.write_arguments(self._key(position) + '"')
            self._opened = True
        self._pending = "\n" if pending.endswith("\n") else ""
        out.write_arguments(_escaped(pending.removesuffix("\n")))

    def end(self, out: StreamOutput, position: int) -> None:
        if self.type_name not in STRING_TYPES:
            text = "".join(self._parts).removeprefix("\n").removesuffix("\n")
            out.write_arguments(self._key(position) + json_value(text, self.type_name))
            return
        value = self._pending.removesuffix("\n")
        if self._opened:
            out.write_arguments(_escaped(value) + '"')
        else:
            out.write_arguments(self._key(position) + ("null" if value.lower() == "null" else json.dumps(
                value, ensure_ascii=False)))

    def _key(self, position: int) -> str:
        return (", " if position else "") + json.dumps(self.name, ensure_ascii=False) + ": "


def _escaped(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)[1:-1]
