"""Tool calls out of generated text: one parser per vLLM `--tool-call-parser` name, each
reading its model family's call format from a whole output (`parse`) or as it streams
(`feed`, `finish`), and the schemas and readers for a forced tool_choice.

One rule for whole and streamed output alike, where vLLM's two paths differ: content is all
the text outside the calls (before, between and after them; whitespace-only stretches are
none), arguments are the JSON object written as json.dumps writes it, and a call's text that
proves malformed before its name and arguments begin goes back into the content (see
parser.py). Pure Python on purpose: the gateway imports no torch.

May import: the standard library; nothing else of the gateway.
"""

from __future__ import annotations

from spillway.gateway.text.tool_calls.calls import ToolCall, ToolCallDelta, new_call_id
from spillway.gateway.text.tool_calls.deepseek import DeepSeekV3Parser, DeepSeekV31Parser
from spillway.gateway.text.tool_calls.hermes import HermesParser
from spillway.gateway.text.tool_calls.llama3_json import Llama3JsonParser
from spillway.gateway.text.tool_calls.mistral import MistralParser
from spillway.gateway.text.tool_calls.parser import ToolParser
from spillway.gateway.text.tool_calls.qwen3_coder import Qwen3CoderParser
from spillway.gateway.text.tool_calls.required import named_call, parse_required, required_schema

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesParser,
    "qwen3_coder": Qwen3CoderParser,
    "llama3_json": Llama3JsonParser,
    "llama4_json": Llama3JsonParser,  # vLLM's name for the same format on Llama 4
    "mistral": MistralParser,
    "deepseek_v3": DeepSeekV3Parser,
    "deepseek_v31": DeepSeekV31Parser,
}


def tool_parser(name: str, tools: list[dict]) -> ToolParser:
    """A fresh parser (one per request and choice: it keeps the stream's state) for `tools`."""
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of {', '.join(TOOL_PARSERS)}")
    return TOOL_PARSERS[name](tools)


__all__ = [
    "TOOL_PARSERS", "ToolCall", "ToolCallDelta", "ToolParser", "named_call", "new_call_id", "parse_required",
    "required_schema", "tool_parser",
]
