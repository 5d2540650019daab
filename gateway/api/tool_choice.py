"""A chat request's `tools` and `tool_choice`, checked as vLLM checks them, and what each asks of
the server:

    tool_choice        the tools in the prompt   the output                 its tool calls
    "none"             no (vLLM's default)       free                       none
    "auto" (default)   yes                       free                       the --tool-call-parser's
    "required"         yes                       a JSON array of calls      every element
    {function: NAME}   yes                       NAME's parameters (JSON)   one call of NAME

"auto" needs the server started with --enable-auto-tool-choice and --tool-call-parser, as in
vLLM; "required" and a named function are held to their JSON by the worker's grammar
(structured outputs: gateway/generation/tool_answers.py's `tool_constraint`), so their output
always parses, whatever the parser.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from spillway.gateway.api.openai import ApiError, ChatCompletionRequest, bad_request
from spillway.gateway.api.structured_outputs import StructuredOutputsParams

AUTO_NEEDS_FLAGS = ('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set')


@dataclass(frozen=True, slots=True)
class ToolUse:
    """The tools of a request that may call them: `mode` "auto", "required" or "named" (then
    `name` is the function's)."""

    mode: str
    tools: list[dict]
    name: str | None = None
    parallel: bool = True


def tool_use(request: ChatCompletionRequest, auto_enabled: bool) -> ToolUse | None:
    """What the request's tools ask for; None where no tool may be called. ApiError (400) for a
    malformed tool or choice, a named function that is not among the tools, or "auto" on a
    server without a tool-call parser."""
    tools, choice = request.tools or [], request.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise bad_request("tool_choice needs tools", param="tool_choice")
        return None
    checked = [_checked_tool(tool, index) for index, tool in enumerate(tools)]
    parallel = request.parallel_tool_calls is not False
    if choice == "none":
        return None
    if choice is None or choice == "auto":
        if not auto_enabled:  # tools alone ask for "auto": named as what was sent
            param = "tools" if choice is None else "tool_choice"
            raise bad_request(f"{param}: {AUTO_NEEDS_FLAGS}", param=param)
        return ToolUse("auto", checked, parallel=parallel)
    if choice == "required":
        return ToolUse("required", checked, parallel=parallel)
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if not any(tool["function"]["name"] == name for tool in checked):
            raise bad_request(f"tool_choice names the function {name!r}, which is not among the tools",
                              param="tool_choice")
        return ToolUse("named", checked, name=name, parallel=parallel)
    raise bad_request('tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                      '{"name": ...}}', param="tool_choice")


def _checked_tool(tool: Any, index: int) -> dict:
    where = f"tools[{index}]"
    if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(
            tool.get("function"), dict):
        raise bad_request(f'{where} must be {{"type": "function", "function": {{"name": ...}}}}', param="tools")
    function = tool["function"]
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise bad_request(f"{where}.function.name must be a non-empty string", param="tools")
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise bad_request(f"{where}.function.parameters must be a JSON schema object", param="tools")
    return {"type": "function", "function": function}


def check_no_other_constraint(use: ToolUse, structured: StructuredOutputsParams | None) -> None:
    """"required" and a named function hold the output to their calls' JSON: no room for another."""
    if use.mode != "auto" and structured is not None:
        raise ApiError(400, f'tool_choice "{use.mode}" holds the output to its calls; it cannot also follow '
                            "response_format or structured_outputs", param="tool_choice")
