"""Calls under a forced tool_choice, where the engine constrains the output to a JSON schema
instead of parsing a model's own call format.

tool_choice "required": the output is a JSON array of one or more {"name", "parameters"}
objects, the schema vLLM uses (`required_schema`); `parse_required` reads it back. A named
tool_choice: the output is that function's arguments object itself (`named_call`).
"""

from __future__ import annotations

import json

from spillway.gateway.text.tool_calls.calls import ToolCall, new_call_id

_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


def required_schema(tools: list[dict]) -> dict:
    """The JSON schema of an output that calls at least one of `tools`.

    Each tool's "$defs" move up to the schema's root, where the tools' "$ref"s (written
    against their own root) still find them; two tools defining one name differently is a
    ValueError.
    """
    alternatives = []
    shared_defs: dict[str, object] = {}
    for tool in tools:
        function = tool["function"]
        parameters = dict(function.get("parameters") or _EMPTY_PARAMETERS)
        for def_name, definition in parameters.pop("$defs", {}).items():
            if shared_defs.setdefault(def_name, definition) != definition:
                raise ValueError(f"tools define {def_name!r} in $defs differently")
        alternatives.append({
            "properties": {"name": {"type": "string", "enum": [function["name"]]}, "parameters": parameters},
            "required": ["name", "parameters"],
        })
    schema: dict = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": alternatives}}
    if shared_defs:
        schema["$defs"] = shared_defs
    return schema


def parse_required(text: str, tools: list[dict]) -> list[ToolCall]:
    """The calls of an output written to `required_schema(tools)`; [] when the text is not
    such an array (cut short by max_tokens, say) or names a function not among `tools`."""
    names = {tool["function"]["name"] for tool in tools}
    try:
        entries = json.loads(text)
    except ValueError:
        return []
    if not isinstance(entries, list) or not entries:
        return []
    calls = []
    for entry in entries:
        if not (isinstance(entry, dict) and entry.get("name") in names and isinstance(entry.get("parameters"), dict)):
            return []
        calls.append(ToolCall(new_call_id(), entry["name"], json.dumps(entry["parameters"], ensure_ascii=False)))
    return calls


def named_call(name: str, text: str) -> ToolCall:
    """The call of a named tool_choice, whose whole output is the arguments object."""
    return ToolCall(new_call_id(), name, text.strip())
