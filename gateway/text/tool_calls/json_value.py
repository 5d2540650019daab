"""Incremental JSON: reads one value a piece at a time, checks it, and writes it back out in
json.dumps's form (", " and ": " separators, non-ASCII kept as is) piece by piece.

What has been written is always a prefix that closing quotes and brackets alone complete into
valid JSON: a member's separator and key go out with the first text of its value, and numbers
and literals go out whole. So a value cut short or broken can still be closed (`close`), and
the pieces of a streamed value join to exactly what a whole read writes.

Tool-call readers need to know which member of a top-level object each piece belongs to (a
call's "name" or its "arguments"), so every piece is tagged with that member's key, or None
for the top-level object's own braces, separators and keys.

Lenient where models are: raw control characters inside strings are accepted (and written
escaped). Lone UTF-16 surrogate escapes, which no UTF-8 text can carry, become U+FFFD.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from enum import IntEnum

_SPACE = " \t\n\r"
_NUMBER_CHARS = frozenset("0123456789+-.eE")
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_PLAIN_RUN = re.compile(r'[^"\\]+')
_HEX = frozenset("0123456789abcdefABCDEF")
_SIMPLE_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_LITERALS = ("true", "false", "null")


class Expect(IntEnum):
    VALUE = 0
    FIRST_KEY = 1  # just after '{': a key or '}'
    KEY = 2  # after a ',' in an object
    COLON = 3
    OBJECT_NEXT = 4  # after a member's value: ',' or '}'
    FIRST_ITEM = 5  # just after '[': a value or ']'
    ARRAY_NEXT = 6  # after an item: ',' or ']'
    STRING = 7
    KEY_STRING = 8
    NUMBER = 9
    LITERAL = 10
    DONE = 11


class _Fault(Exception):
    def __init__(self, position: int) -> None:
        self.position = position


@dataclass(slots=True)
class JsonStream:
    """One JSON value, read incrementally; `pieces` holds (member, text) written since the last
    `take_pieces`."""

    expect: Expect = Expect.VALUE
    failed: bool = False
    member: str | None = None  # the top-level object's member whose value is being read
    started_member: str | None = None  # set when `feed` stopped at the start of that member's value
    ended_member: str | None = None  # set when `feed` stopped at the end of that member's value
    pieces: list[tuple[str | None, str]] = field(default_factory=list)
    _stack: list[str] = field(default_factory=list)  # open containers, "{" or "["
    _owed: str | None = None  # separator and key to write before the next value's first text
    _owed_member: str | None = None
    _token: str = ""  # a number, literal or key being read
    _separator: str = ""
    _escape: str = ""  # an escape sequence being read, from its backslash
    _high_surrogate: int = 0  # a \uD800-\uDBFF escape waiting for its low half

    @property
    def done(self) -> bool:
        return self.expect == Expect.DONE

    def feed(self, text: str, pos: int = 0) -> int:
        """Reads text[pos:] up to the end of the value, a fault (`failed`; the faulty character
        is not consumed), or the start or end of a top-level member's value (`started_member`,
        `ended_member`: readers act there, whatever the cut of the text); returns where it
        stopped."""
        self.started_member = self.ended_member = None
        if self.failed:
            return pos
        try:
            while (pos < len(text) and self.expect != Expect.DONE and self.started_member is None
                   and self.ended_member is None):
                pos = self._step(text, pos)
        except _Fault as fault:
            self.failed = True
            return fault.position
        return pos

    def take_pieces(self) -> list[tuple[str | None, str]]:
        pieces, self.pieces = self.pieces, []
        return pieces

    def close(self) -> None:
        """Writes what completes the text written so far into one valid value: a string cut
        short is closed where it stopped, a whole number is kept, a member or item whose value
        had not begun is dropped, and open containers are closed."""
        if self.expect == Expect.DONE:
            return
        if self.expect == Expect.STRING:
            tail: list[str] = []
            self._flush_high_surrogate(tail)
            self._write(_escaped("".join(tail)) + '"')
            self._value_done()
        elif self.expect == Expect.NUMBER and _NUMBER.fullmatch(self._token):
            self._write(_canonical_number(self._token))
            self._value_done()
        if self._owed is not None:
            self._owed = None
            if len(self._stack) == 1 and self._stack[0] == "{":
                self.member = None
        while self._stack:
            self._close_container()
        self.expect = Expect.DONE

    def _step(self, text: str, pos: int) -> int:
        char = text[pos]
        expect = self.expect
        if expect in (Expect.STRING, Expect.KEY_STRING):
            return self._string_step(text, pos)
        if expect == Expect.NUMBER:
            if char in _NUMBER_CHARS:
                self._token += char
                return pos + 1
            if not _NUMBER.fullmatch(self._token):
                raise _Fault(pos)
            self._write(_canonical_number(self._token))
            self._value_done()
            return pos
        if expect == Expect.LITERAL:
            self._token += char
            if self._token in _LITERALS:
                self._write(self._token)
                self._value_done()
            elif not any(literal.startswith(self._token) for literal in _LITERALS):
                raise _Fault(pos)
            return pos + 1
        if char in _SPACE:
            return pos + 1
        match expect:
            case Expect.VALUE:
                self._start_value(char, pos)
            case Expect.FIRST_KEY | Expect.KEY:
                if char == '"':
                    self._separator = "" if expect == Expect.FIRST_KEY else ", "
                    self._token = ""
                    self.expect = Expect.KEY_STRING
                elif char == "}" and expect == Expect.FIRST_KEY:
                    self._close_container()
                else:
                    raise _Fault(pos)
            case Expect.COLON:
                if char != ":":
                    raise _Fault(pos)
                self._owed = self._separator + json.dumps(self._token, ensure_ascii=False) + ": "
                if len(self._stack) == 1:
                    self._owed_member, self.member = None, self._token
                else:
                    self._owed_member = self.member
                self.expect = Expect.VALUE
            case Expect.OBJECT_NEXT | Expect.ARRAY_NEXT:
                closer = "}" if expect == Expect.OBJECT_NEXT else "]"
                if char == ",":
                    self.expect = Expect.KEY if expect == Expect.OBJECT_NEXT else Expect.VALUE
                    if expect == Expect.ARRAY_NEXT:
                        self._owed, self._owed_member = ", ", self.member
                elif char == closer:
                    self._close_container()
                else:
                    raise _Fault(pos)
            case Expect.FIRST_ITEM:
                if char == "]":
                    self._close_container()
                else:
                    self.expect = Expect.VALUE
                    return pos
        return pos + 1

    def _start_value(self, char: str, pos: int) -> None:
        if char == "{" or char == "[":
            self._write(char)
            self._stack.append(char)
            self.expect = Expect.FIRST_KEY if char == "{" else Expect.FIRST_ITEM
        elif char == '"':
            self._write('"')
            self.expect = Expect.STRING
        elif char == "-" or char.isdigit():
            self._token = char
            self.expect = Expect.NUMBER
        elif char in "tfn":
            self._token = char
            self.expect = Expect.LITERAL
        else:
            raise _Fault(pos)

    def _string_step(self, text: str, pos: int) -> int:
        decoded: list[str] = []
        try:
            pos, closed = self._read_string(text, pos, decoded)
        finally:  # text decoded before a fault is still written
            if decoded and self.expect == Expect.STRING:
                self._write(_escaped("".join(decoded)))
            elif decoded:
                self._token += "".join(decoded)
        if closed and self.expect == Expect.STRING:
            self._write('"')
            self._value_done()
        elif closed:
            self.expect = Expect.COLON
        return pos

    def _read_string(self, text: str, pos: int, decoded: list[str]) -> tuple[int, bool]:
        """Decodes string characters up to the closing quote (consumed; True) or the text's end."""
        while pos < len(text):
            char = text[pos]
            if self._escape:
                self._escape += char
                if len(self._escape) == 2 and char != "u":
                    if char not in _SIMPLE_ESCAPES:
                        raise _Fault(pos)
                    self._escape = ""
                    self._flush_high_surrogate(decoded)
                    decoded.append(_SIMPLE_ESCAPES[char])
                elif len(self._escape) > 2:
                    if char not in _HEX:
                        raise _Fault(pos)
                    if len(self._escape) == 6:
                        code_unit, self._escape = int(self._escape[2:], 16), ""
                        self._decode_code_unit(code_unit, decoded)
                pos += 1
            elif char == '"':
                self._flush_high_surrogate(decoded)
                return pos + 1, True
            elif char == "\\":
                self._escape = "\\"
                pos += 1
            else:
                run = _PLAIN_RUN.match(text, pos)
                self._flush_high_surrogate(decoded)
                decoded.append(run.group())
                pos = run.end()
        return pos, False

    def _decode_code_unit(self, code_unit: int, decoded: list[str]) -> None:
        if 0xDC00 <= code_unit <= 0xDFFF:
            if self._high_surrogate:
                decoded.append(chr(0x10000 + ((self._high_surrogate - 0xD800) << 10) + (code_unit - 0xDC00)))
                self._high_surrogate = 0
            else:
                decoded.append("\ufffd")
            return
        self._flush_high_surrogate(decoded)
        if 0xD800 <= code_unit <= 0xDBFF:
            self._high_surrogate = code_unit
        else:
            decoded.append(chr(code_unit))

    def _flush_high_surrogate(self, decoded: list[str]) -> None:
        if self._high_surrogate:
            decoded.append("\ufffd")
            self._high_surrogate = 0

    def _write(self, text: str) -> None:
        if self._owed is not None:
            if self._owed:
                self.pieces.append((self._owed_member, self._owed))
            if self._owed_member is None and self.member is not None:
                self.started_member = self.member
            self._owed = None
        self.pieces.append((self.member, text))

    def _close_container(self) -> None:
        self._write("}" if self._stack.pop() == "{" else "]")
        self._value_done()

    def _value_done(self) -> None:
        if not self._stack:
            self.expect = Expect.DONE
        elif self._stack[-1] == "[":
            self.expect = Expect.ARRAY_NEXT
        else:
            self.expect = Expect.OBJECT_NEXT
            if len(self._stack) == 1 and self.member is not None:
                self.ended_member, self.member = self.member, None


def _escaped(text: str) -> str:
    """String characters as json.dumps writes them inside quotes (escaping is per character,
    so pieces escaped apart join to the whole escaped)."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


def _canonical_number(token: str) -> str:
    value = json.loads(token)
    if isinstance(value, float) and not math.isfinite(value):
        return token  # json.dumps would write Infinity, which is not JSON
    return json.dumps(value)
