"""What a request's answer must match, as users say it: vLLM's `StructuredOutputsParams` (offline
and the `structured_outputs` field), OpenAI's `response_format`, and vLLM's older `guided_json`,
`guided_regex`, `guided_choice` and `guided_grammar` fields, honoured rather than ignored.

Each becomes one wire `StructuredOutput` (protocol/messages.py): a kind and its text. Only the
shape is checked here; whether the grammar library accepts a schema, regex or grammar is
checked by compiling it (gateway/text/grammars.py) before the request reaches the worker.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

from spillway.protocol.messages import StructuredKind, StructuredOutput

# The constraint fields of StructuredOutputsParams, one of which is set.
CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
MAX_CHOICES = 1024


@dataclass(slots=True)
class StructuredOutputsParams:
    """vLLM's `StructuredOutputsParams`: exactly one of `json` (a JSON schema, dict or text),
    `regex`, `choice` (strings), `grammar` (EBNF/Lark), `json_object=True` (any JSON object)
    or `structural_tag` (JSON text). `backend` may name vLLM's backends ("auto", "xgrammar",
    "guidance", "outlines", "lm-format-enforcer"): Spillway runs its one library for all.
    `disable_any_whitespace` drops the free whitespace between JSON tokens;
    `disable_additional_properties` is taken as it is: a schema's objects are closed already
    (the worker compiles schemas strictly, as vLLM runs xgrammar).
    Invalid combinations raise ValueError at construction."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    backend: str | None = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        chosen = [name for name in CONSTRAINTS if getattr(self, name) not in (None, False)]
        if len(chosen) != 1:
            raise ValueError("structured outputs take exactly one of " + ", ".join(CONSTRAINTS)
                             + (f"; got {', '.join(chosen)}" if chosen else "; got none"))
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(f"json must be a JSON schema (an object or its text), got {type(self.json).__name__}")
        if isinstance(self.json, str):
            try:
                schema = json.loads(self.json)
            except ValueError as error:
                raise ValueError(f"json is not valid JSON: {error}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError("json must be a JSON schema: an object")
        for name in ("regex", "grammar", "structural_tag"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name} must be a non-empty string")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise ValueError("choice must be a non-empty list of non-empty strings")
            if len(self.choice) > MAX_CHOICES:
                raise ValueError(f"choice takes at most {MAX_CHOICES} strings, got {len(self.choice)}")
        if self.json_object not in (None, True, False):
            raise ValueError("json_object must be true or false")
        if self.whitespace_pattern is not None:
            raise ValueError("whitespace_pattern is not supported (disable_any_whitespace is)")

    @property
    def kind(self) -> StructuredKind:
        return next(StructuredKind(name) for name in CONSTRAINTS if getattr(self, name) not in (None, False))

    def to_wire(self) -> StructuredOutput:
        kind = self.kind
        if kind is StructuredKind.JSON:
            # Key order kept: the properties come out in the schema's order.
            spec = self.json if isinstance(self.json, str) else json.dumps(self.json)
        elif kind is StructuredKind.CHOICE:
            spec = json.dumps(list(self.choice))
        elif kind is StructuredKind.JSON_OBJECT:
            spec = ""
        else:
            spec = getattr(self, kind.value)
        return StructuredOutput(kind=kind, spec=spec, compact=self.disable_any_whitespace)


def from_fields(values: dict[str, Any], where: str) -> StructuredOutputsParams:
    """A `structured_outputs` object of a request (vLLM's field); `where` names it in errors."""
    if not isinstance(values, dict):
        raise ValueError(f"{where} must be an object")
    known = {f.name for f in fields(StructuredOutputsParams)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"{where}: unknown field {unknown[0]!r}; known: {', '.join(sorted(known))}")
    return StructuredOutputsParams(**values)


def from_response_format(response_format: Any) -> StructuredOutputsParams | None:
    """OpenAI's `response_format`: `text` (None), `json_object`, `json_schema` (its `schema`;
    `strict` accepted: the output always follows the schema), or vLLM's `structural_tag`."""
    kind = response_format.type
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = response_format.json_schema
        if not isinstance(spec, dict) or "schema" not in spec:
            raise ValueError("response_format json_schema needs json_schema.schema (and a name)")
        return StructuredOutputsParams(json=spec["schema"])
    if kind == "structural_tag":
        return StructuredOutputsParams(structural_tag=json.dumps(response_format.structural_tag or {}))
    raise ValueError(f"response_format type {kind!r} is not one of text, json_object, json_schema, structural_tag")
