"""Parameter values written as plain text (Qwen3-Coder's XML calls) turned into JSON values by
the type the tool's schema gives the parameter, the way vLLM's qwen3_coder parser does: text
that does not read as its type stays a string (a boolean that is not "true" reads as false).
"""

from __future__ import annotations

import ast
import json
import math

STRING_TYPES = frozenset({"string", "str", "text", "varchar", "char", "enum"})
_INTEGER_PREFIXES = ("int", "uint", "long", "short", "unsigned")
_CONTAINER_TYPES = frozenset({"object", "array", "arr"})


def parameter_types(tools: list[dict]) -> dict[str, dict[str, str]]:
    """function name -> parameter name -> its schema type, lower-cased ("string" where the
    schema gives none)."""
    types: dict[str, dict[str, str]] = {}
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            continue
        parameters = function.get("parameters")
        properties = parameters.get("properties") if isinstance(parameters, dict) else None
        if isinstance(properties, dict):
            types[function["name"]] = {name: schema_type(schema) for name, schema in properties.items()}
    return types


def schema_type(schema: object) -> str:
    """The type a property's schema names: its "type" (the first besides "null" of a list),
    else that of its first typed anyOf/oneOf alternative, else "string"."""
    if not isinstance(schema, dict):
        return "string"
    declared = schema.get("type")
    if isinstance(declared, list):
        declared = next((entry for entry in declared if entry != "null"), None)
    if isinstance(declared, str):
        return declared.strip().lower()
    alternatives = [entry for key in ("anyOf", "oneOf") if isinstance(schema.get(key), list) for entry in schema[key]]
    for alternative in alternatives:
        if isinstance(alternative, dict) and alternative.get("type") not in (None, "null"):
            return schema_type(alternative)
    return "string"


def json_value(text: str, type_name: str) -> str:
    """The JSON text of a parameter value of schema type `type_name`."""
    value = _converted(text, type_name)
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError):  # literal_eval gave something JSON cannot hold
        return json.dumps(text, ensure_ascii=False)


def _converted(text: str, type_name: str) -> object:
    if text.lower() == "null":
        return None
    if type_name in STRING_TYPES:
        return text
    if type_name.startswith(_INTEGER_PREFIXES):
        try:
            return int(text)
        except ValueError:
            return text
    if type_name.startswith(("num", "float")):
        try:
            return int(text)
        except ValueError:
            pass
        try:
            number = float(text)
        except ValueError:
            return text
        if not math.isfinite(number):
            return text
        return int(number) if number.is_integer() else number
    if type_name in ("boolean", "bool", "binary"):
        return text.lower() == "true"
    if type_name in _CONTAINER_TYPES or type_name.startswith(("dict", "list")):
        try:
            return json.loads(text)
        except ValueError:
            pass
    try:
        return ast.literal_eval(text)
    except Exception:  # any text at all may arrive here, and it stays a string
        return text
