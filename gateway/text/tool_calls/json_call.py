"""Readers for calls written in JSON: a call object {"name": ..., "arguments": {...}}, or a
bare arguments object after a name the format gave elsewhere.

A reader consumes text, writes the call to a StreamOutput as it becomes known, and says how it
went: `done` when the JSON ended well, `failed` when it turned out malformed. A call is
*committed* (opened on the output) once its name is a string and its arguments have begun as an
object, or the object ended without them (arguments "{}"). A call that fails before that is
the parser's to hand back as content; one that fails after keeps the arguments read up to the
fault, closed into a valid object, since its name and first arguments are already out.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from spillway.gateway.text.tool_calls.json_value import JsonStream
from spillway.gateway.text.tool_calls.output import StreamOutput


@dataclass(slots=True)
class JsonCallReader:
    """One call object. `argument_keys` names the member that holds the arguments (Llama
    writes "parameters"); the first of them present is used and any later one ignored."""

    argument_keys: tuple[str, ...] = ("arguments",)
    name: str | None = None
    committed: bool = False
    failed: bool = False
    _json: JsonStream = field(default_factory=JsonStream)
    _name_text: list[str] = field(default_factory=list)
    _name_read: bool = False
    _arguments_key: str | None = None
    _arguments_ended: bool = False
    _held_arguments: list[str] = field(default_factory=list)  # read before the name

    @property
    def done(self) -> bool:
        return self._json.done and not self.failed

    def read(self, text: str, pos: int, out: StreamOutput) -> int:
        """Reads text[pos:] as far as the call goes; returns where it stopped."""
        while pos < len(text) and not self._json.done and not self.failed:
            pos = self._json.feed(text, pos)
            self._route(out)
            if self._json.failed:
                self._fail(out)
            elif self._json.ended_member is not None:
                self._member_ended(self._json.ended_member)
            if not self.failed:
                self._commit_when_ready(out)
        if self._json.done and not self.committed and not self.failed:
            self.failed = True  # a whole object without a usable name
        return pos

    def finish(self, out: StreamOutput) -> None:
        """The text ended inside the object: a committed call's arguments are closed."""
        if self.committed and not self._json.done:
            self._json.close()
            self._route(out)

    def _route(self, out: StreamOutput) -> None:
        for member, text in self._json.take_pieces():
            if member == "name" and not self._name_read:
                self._name_text.append(text)
            elif member in self.argument_keys and not self._arguments_ended:
                if self._arguments_key is None:
                    if not text.startswith("{"):
                        self._fail(out)
                        return
                    self._arguments_key = member
                elif member != self._arguments_key:
                    continue
                if self.committed:
                    out.write_arguments(text)
                else:
                    self._held_arguments.append(text)

    def _member_ended(self, key: str) -> None:
        if key == "name" and not self._name_read:
            self._name_read = True
            try:
                name = json.loads("".join(self._name_text))
            except ValueError:
                name = None
            if not isinstance(name, str) or not name:
                self.failed = True
                return
            self.name = name
        elif key == self._arguments_key:
            self._arguments_ended = True

    def _commit_when_ready(self, out: StreamOutput) -> None:
        if self.committed or self.name is None or not (self._arguments_key is not None or self._json.done):
            return
        self.committed = True
        out.open_call(self.name)
        out.write_arguments("".join(self._held_arguments) if self._arguments_key is not None else "{}")
        self._held_arguments = []

    def _fail(self, out: StreamOutput) -> None:
        self.failed = True
        if self.committed:
            self._json.close()
            self._route(out)


@dataclass(slots=True)
class JsonArgumentsReader:
    """A call's arguments object, read after the parser opened the call (it checked the `{`)."""

    committed: bool = True
    failed: bool = False
    _json: JsonStream = field(default_factory=JsonStream)

    @property
    def done(self) -> bool:
        return self._json.done and not self.failed

    def read(self, text: str, pos: int, out: StreamOutput) -> int:
        while pos < len(text) and not self._json.done and not self.failed:
            pos = self._json.feed(text, pos)
            if self._json.failed:
                self.failed = True
                self._json.close()
            for _, piece in self._json.take_pieces():
                out.write_arguments(piece)
        return pos

    def finish(self, out: StreamOutput) -> None:
        if not self._json.done:
            self._json.close()
            for _, piece in self._json.take_pieces():
                out.write_arguments(piece)
