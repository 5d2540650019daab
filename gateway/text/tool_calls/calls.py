"""What a tool-call parser produces: whole calls, the deltas that stream them, and call ids."""

from __future__ import annotations

import random
import string
from collections.abc import Iterable
from dataclasses import dataclass

_ALPHANUMERIC = string.ascii_letters + string.digits


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One complete call, as OpenAI's message.tool_calls[i] carries it."""

    id: str
    name: str
    arguments: str  # a JSON object as text


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """One streamed piece of a call, as OpenAI's delta.tool_calls[i] carries it.

    A call's first delta carries its id and name; the arguments fragments of one index join,
    in order, to the call's whole arguments text.
    """

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


def new_call_id() -> str:
    """An OpenAI-style call id: "call_" and 24 random letters and digits."""
    return "call_" + "".join(random.choices(_ALPHANUMERIC, k=24))


def new_mistral_call_id() -> str:
    """Mistral's chat format accepts only ids of exactly 9 letters and digits."""
    return "".join(random.choices(_ALPHANUMERIC, k=9))


def calls_from_deltas(deltas: Iterable[ToolCallDelta]) -> list[ToolCall]:
    """The calls a stream of deltas spells out, in index order."""
    heads: dict[int, ToolCallDelta] = {}
    arguments: dict[int, list[str]] = {}
    for delta in deltas:
        if delta.index not in heads:
            assert delta.id is not None and delta.name is not None, "a call's first delta names it"
            heads[delta.index] = delta
            arguments[delta.index] = []
        arguments[delta.index].append(delta.arguments)
    return [ToolCall(heads[index].id, heads[index].name, "".join(arguments[index])) for index in sorted(heads)]
