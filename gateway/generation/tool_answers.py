"""A chat choice's tool calls, from its content text, whole or as it streams (gateway/api/tool_choice.py
says which mode a request is in):

    auto       the --tool-call-parser's (gateway/text/tool_calls/) split of the content into
               text and calls, streamed as the parser decides them
    required   the content is a JSON array of calls (the grammar made it so): its calls, each
               sent whole when the choice ends; no text
    named      the content is the named function's arguments (the grammar's JSON): one call,
               its arguments streamed as they come; no text

A choice that made calls ends with finish_reason "tool_calls" (auto, required), as vLLM's do
whatever ended it; one whose function was named keeps its own ("stop" where it ended by itself).
"""

from __future__ import annotations

from spillway.gateway.api.structured_outputs import StructuredOutputsParams
from spillway.gateway.api.tool_choice import ToolUse
from spillway.gateway.text.tool_calls import named_call, parse_required, required_schema, tool_parser
from spillway.gateway.text.tool_calls.calls import ToolCall, ToolCallDelta, new_call_id


def tool_constraint(use: ToolUse) -> StructuredOutputsParams | None:
    """The grammar "required" (vLLM's array of calls; one at most without parallel tool calls)
    and a named function (its parameters) hold the output to; None for "auto". ValueError for
    tools whose schemas cannot be joined."""
    if use.mode == "required":
        schema = required_schema(use.tools)
        if not use.parallel:
            schema["maxItems"] = 1
        return StructuredOutputsParams(json=schema)
    if use.mode == "named":
        function = next(tool["function"] for tool in use.tools if tool["function"]["name"] == use.name)
        return StructuredOutputsParams(json=function.get("parameters") or {"type": "object"})
    return None


class ToolCallStream:
    """One choice's content through its tool-call mode: `feed` each piece of content text,
    `finish` at its end; each returns (text to send as content, tool-call deltas)."""

    def __init__(self, use: ToolUse, parser_name: str | None) -> None:
        self.use = use
        self._parser = tool_parser(parser_name, use.tools) if use.mode == "auto" else None
        self._held: list[str] = []  # required: the whole array, parsed at the end
        self._named_id: str | None = None
        self.num_calls = 0

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        if self._parser is not None:
            return self._count(self._parser.feed(text))
        if self.use.mode == "required":
            self._held.append(text)
            return "", []
        if not text:
            return "", []
        if self._named_id is None:  # named: the content is the arguments
            self._named_id = new_call_id()
            self.num_calls = 1
            return "", [ToolCallDelta(0, self._named_id, self.use.name, text)]
        return "", [ToolCallDelta(0, arguments=text)]

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        if self._parser is not None:
            return self._count(self._parser.finish())
        if self.use.mode == "required":
            calls = parse_required("".join(self._held), self.use.tools)
            self.num_calls = len(calls)
            return "", [ToolCallDelta(index, call.id, call.name, call.arguments) for index, call in enumerate(calls)]
        return "", []

    def _count(self, result: tuple[str, list[ToolCallDelta]]) -> tuple[str, list[ToolCallDelta]]:
        self.num_calls = max([self.num_calls, *(delta.index + 1 for delta in result[1])])
        return result

    def finish_reason(self, reason: str | None) -> str | None:
        """The choice's finish reason once it made calls (the module doc)."""
        return tool_finish_reason(self.use, self.num_calls, reason)


def whole_tool_calls(use: ToolUse, parser_name: str | None, text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a whole choice's content text."""
    if use.mode == "auto":
        return tool_parser(parser_name, use.tools).parse(text)
    if use.mode == "required":
        return None, parse_required(text, use.tools)
    return None, [named_call(use.name, text)] if text.strip() else []


def tool_finish_reason(use: ToolUse, num_calls: int, reason: str | None) -> str | None:
    """A finished choice's reason once it made `num_calls` calls (the module doc)."""
    return "tool_calls" if reason is not None and num_calls and use.mode != "named" else reason
