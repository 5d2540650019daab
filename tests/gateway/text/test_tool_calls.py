"""Tool-call parsers: each format read whole and streamed in pieces of every size from 1 to 7
characters, which must agree exactly; the registry; tool_choice "required" and named calls."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import jsonschema
import pytest

from spillway.gateway.text.tool_calls import (
    TOOL_PARSERS,
    ToolCall,
    named_call,
    parse_required,
    required_schema,
    tool_parser,
)
from spillway.gateway.text.tool_calls.deepseek import CALL_BEGIN, CALL_END, CALLS_BEGIN, CALLS_END, SEP

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                         "metric": {"type": "boolean"}},
        "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string"}, "offset": {"type": "number"},
                                         "options": {"type": "object"}, "fields": {"type": "array"}}}}},
]

PLAIN = "It is sunny in Paris.\nBring <b>sunglasses</b> & a hat: [see] {this}; a < b."
PARIS = '{"city": "Paris"}'
ZONE = '{"zone": "Europe/Paris"}'

# parser -> case -> (output, expected content, expected (name, arguments) calls)
CASES = {
    "hermes": {
        "one": ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>',
                None, [("get_weather", '{"city": "Paris", "days": 3}')]),
        "two": ('Let me check both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "Europe/Paris"}}\n'
                '</tool_call>\n',
                "Let me check both.\n", [("get_weather", PARIS), ("get_time", ZONE)]),
        "malformed": ('Checking.\n<tool_call>\n{"name": get_weather, "arguments": {}}\n</tool_call>', "SAME", []),
    },
    "qwen3_coder": {
        "one": ('<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n'
                '</parameter>\n</function>\n</tool_call>',
                None, [("get_weather", '{"city": "Paris", "days": 3}')]),
        "two": ("Let me check both.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                "<parameter=metric>\nTrue\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n"
                "<parameter=zone>\nEurope/Paris\n</parameter>\n<parameter=offset>\n1.5\n</parameter>\n"
                '<parameter=options>\n{"dst": true}\n</parameter>\n<parameter=fields>\n["h", "m"]\n</parameter>\n'
                "</function>\n</tool_call>",
                "Let me check both.\n",
                [("get_weather", '{"city": "Paris", "metric": true}'),
                 ("get_time",
                  '{"zone": "Europe/Paris", "offset": 1.5, "options": {"dst": true}, "fields": ["h", "m"]}')]),
        "malformed": ('Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
                      "SAME", []),
    },
    "llama3_json": {
        "one": ('{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}',
                None, [("get_weather", '{"city": "Paris", "days": 3}')]),
        "two": ('Let me check both.<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
                '{"name": "get_time", "arguments": {"zone": "Europe/Paris"}}',
                "Let me check both.", [("get_weather", PARIS), ("get_time", ZONE)]),
        "malformed": ('{"name": get_weather, "parameters": {"city": "Paris"}}', "SAME", []),
    },
    "mistral": {
        "one": ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]',
                None, [("get_weather", '{"city": "Paris", "days": 3}')]),
        "two": ('Let me check both.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'
                '[TOOL_CALLS]get_time[ARGS]{"zone": "Europe/Paris"}',
                "Let me check both.", [("get_weather", PARIS), ("get_time", ZONE)]),
        "two_listed": ('Let me check both.[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                       '{"name": "get_time", "arguments": {"zone": "Europe/Paris"}}]',
                       "Let me check both.", [("get_weather", PARIS), ("get_time", ZONE)]),
        "malformed": ('Checking.[TOOL_CALLS] [{"name": get_weather, "arguments": {}}]', "SAME", []),
    },
    "deepseek_v3": {
        "one": (f'{CALLS_BEGIN}{CALL_BEGIN}function{SEP}get_weather\n```json\n{{"city": "Paris", "days": 3}}\n```'
                f"{CALL_END}{CALLS_END}",
                None, [("get_weather", '{"city": "Paris", "days": 3}')]),
        "two": (f"Let me check both.{CALLS_BEGIN}{CALL_BEGIN}function{SEP}get_weather\n```json\n{PARIS}\n```"
                f"{CALL_END}\n{CALL_BEGIN}function{SEP}get_time\n```json\n{ZONE}\n```{CALL_END}{CALLS_END}",
                "Let me check both.", [("get_weather", PARIS), ("get_time", ZONE)]),
        "malformed": (f"Checking.{CALLS_BEGIN}{CALL_BEGIN}function{SEP}get_weather\n```json\ncity=Paris\n```"
                      f"{CALL_END}{CALLS_END}", "SAME", []),
    },
    "deepseek_v31": {
        "one": (f'{CALLS_BEGIN}{CALL_BEGIN}get_weather{SEP}{{"city": "Paris", "days": 3}}{CALL_END}{CALLS_END}',
                None, [("get_weather", '{"city": "Paris", "days": 3}')]),
        "two": (f"Let me check both.{CALLS_BEGIN}{CALL_BEGIN}get_weather{SEP}{PARIS}{CALL_END}"
                f"{CALL_BEGIN}get_time{SEP}{ZONE}{CALL_END}{CALLS_END}",
                "Let me check both.", [("get_weather", PARIS), ("get_time", ZONE)]),
        "malformed": (f"Checking.{CALLS_BEGIN}{CALL_BEGIN}get_weather{SEP}city=Paris{CALL_END}{CALLS_END}", "SAME", []),
    },
}
CASE_IDS = [(parser, case) for parser in CASES for case in ["plain", *CASES[parser]]]


def case(parser: str, name: str) -> tuple[str, str | None, list[tuple[str, str]]]:
    if name == "plain":
        return PLAIN, PLAIN, []
    text, content, calls = CASES[parser][name]
    return text, text if content == "SAME" else content, calls


def streamed(parser_name: str, text: str, piece_size: int) -> tuple[str, list[ToolCall]]:
    """Feeds `text` in pieces of `piece_size` characters; returns the content joined and the
    calls reassembled from the deltas, checking each delta's shape on the way."""
    parser = tool_parser(parser_name, TOOLS)
    content, heads, arguments = [], {}, {}
    pieces = [text[start:start + piece_size] for start in range(0, len(text), piece_size)]
    for released, deltas in [parser.feed(piece) for piece in pieces] + [parser.finish()]:
        content.append(released)
        for delta in deltas:
            if delta.index not in heads:
                assert delta.index == len(heads), "calls are numbered in order"
                assert delta.id and delta.name and delta.arguments == "", "a call opens with its id and name"
                heads[delta.index], arguments[delta.index] = delta, []
            else:
                assert delta.id is None and delta.name is None
                arguments[delta.index].append(delta.arguments)
    calls = [ToolCall(heads[index].id, heads[index].name, "".join(arguments[index])) for index in sorted(heads)]
    return "".join(content), calls


def names_and_arguments(calls: list[ToolCall]) -> list[tuple[str, str]]:
    return [(call.name, call.arguments) for call in calls]


@pytest.mark.parametrize("parser_name, case_name", CASE_IDS)
def test_whole_output_splits_into_content_and_calls(parser_name, case_name):
    text, content, calls = case(parser_name, case_name)
    parsed_content, parsed_calls = tool_parser(parser_name, TOOLS).parse(text)
    assert parsed_content == content
    assert names_and_arguments(parsed_calls) == calls
    assert len({call.id for call in parsed_calls}) == len(parsed_calls)


@pytest.mark.parametrize("parser_name, case_name", CASE_IDS)
def test_stream_in_pieces_of_any_size_matches_the_whole_parse(parser_name, case_name):
    text, _, _ = case(parser_name, case_name)
    content, calls = tool_parser(parser_name, TOOLS).parse(text)
    for piece_size in range(1, 8):
        streamed_content, streamed_calls = streamed(parser_name, text, piece_size)
        assert streamed_content == (content or ""), piece_size
        assert names_and_arguments(streamed_calls) == names_and_arguments(calls), piece_size


def test_call_ids_are_openai_style_except_mistrals():
    _, calls = tool_parser("hermes", TOOLS).parse(CASES["hermes"]["two"][0])
    assert all(re.fullmatch(r"call_[A-Za-z0-9]{24}", call.id) for call in calls)
    _, calls = tool_parser("mistral", TOOLS).parse(CASES["mistral"]["two"][0])
    assert all(re.fullmatch(r"[A-Za-z0-9]{9}", call.id) for call in calls)


def test_name_streams_before_the_arguments_are_complete():
    parser = tool_parser("hermes", TOOLS)
    content, deltas = parser.feed('Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa')
    assert content == "Sure.\n"
    assert [(d.index, d.name, d.arguments) for d in deltas] == [(0, "get_weather", ""), (0, None, '{"city": "Pa')]
    content, deltas = parser.feed('ris"}}\n</tool_call>')
    assert (content, [d.arguments for d in deltas]) == ("", ['ris"}'])
    assert parser.finish() == ("", [])


def test_text_that_may_begin_a_marker_is_held_until_decided():
    parser = tool_parser("hermes", TOOLS)
    assert parser.feed("x <tool_") == ("x ", [])
    assert parser.feed("box") == ("<tool_box", [])
    assert parser.feed(" <tool") == (" ", [])
    assert parser.finish() == ("<tool", [])


def test_whitespace_around_calls_is_no_content():
    text = '\n\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n\n'
    assert names_and_arguments(tool_parser("hermes", TOOLS).parse(text)[1]) == [("get_time", "{}")]
    assert tool_parser("hermes", TOOLS).parse(text)[0] is None
    assert streamed("hermes", text, 3)[0] == ""
    assert tool_parser("hermes", TOOLS).parse("  \n ") == (None, [])


@pytest.mark.parametrize("text, content, calls", [
    # Broken after the name and arguments began streaming: the call keeps what was read, closed.
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": tru}}</tool_call> Done.',
     " Done.", [("get_weather", PARIS)]),
    # Cut short by the end of the output (max_tokens).
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "Par', None, [("get_weather", '{"city": "Par"}')]),
    # Not a call: no name.
    ('<tool_call>{"city": "Paris"}</tool_call>', '<tool_call>{"city": "Paris"}</tool_call>', []),
    # Arguments that are not an object.
    ('<tool_call>{"name": "get_weather", "arguments": "Paris"}</tool_call>',
     '<tool_call>{"name": "get_weather", "arguments": "Paris"}</tool_call>', []),
    # Name after the arguments; no arguments at all.
    ('<tool_call>{"arguments": {"city": "Paris"}, "name": "get_weather"}</tool_call>'
     '<tool_call>{"name": "get_time"}</tool_call>', None, [("get_weather", PARIS), ("get_time", "{}")]),
    # An unclosed call followed by the next one.
    ('<tool_call>{"name": "get_time", "arguments": {}}\n<tool_call>{"name": "get_weather", "arguments": '
     '{"city": "Paris"}}</tool_call>', None, [("get_time", "{}"), ("get_weather", PARIS)]),
])
def test_hermes_edge_cases_agree_whole_and_streamed(text, content, calls):
    parsed_content, parsed_calls = tool_parser("hermes", TOOLS).parse(text)
    assert (parsed_content, names_and_arguments(parsed_calls)) == (content, calls)
    for piece_size in range(1, 8):
        streamed_content, streamed_calls = streamed("hermes", text, piece_size)
        assert (streamed_content, names_and_arguments(streamed_calls)) == (content or "", calls)


def test_arguments_are_written_as_json_dumps_writes_them():
    raw = '{"s":"a\\"b\\\\c\\n\\u00e9\\ud83d\\ude00\\u0001","n":[1.50,-0,1E2,{"k":null}],"t":true}'
    text = f'<tool_call>{{"name": "get_time", "arguments": {raw}}}</tool_call>'
    _, calls = tool_parser("hermes", TOOLS).parse(text)
    assert calls[0].arguments == json.dumps(json.loads(raw), ensure_ascii=False)
    for piece_size in range(1, 8):
        assert streamed("hermes", text, piece_size)[1][0].arguments == calls[0].arguments


def test_qwen3_coder_values_follow_the_schema_types():
    text = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nnull\n</parameter>\n<parameter=days>\nthree\n"
            "</parameter>\n<parameter=unknown>\n42\n</parameter>\n</function>\n</tool_call>\n"
            "<function=get_time>\n<parameter=zone>\n\nline one\nline \"two\"\n\n</parameter>\n"
            "<parameter=offset>\n2.0\n</parameter>\n</function>")
    _, calls = tool_parser("qwen3_coder", TOOLS).parse(text)
    assert names_and_arguments(calls) == [
        ("get_weather", '{"city": null, "days": "three", "unknown": "42"}'),
        ("get_time", '{"zone": "\\nline one\\nline \\"two\\"\\n", "offset": 2}'),
    ]
    for piece_size in range(1, 8):
        assert names_and_arguments(streamed("qwen3_coder", text, piece_size)[1]) == names_and_arguments(calls)


def test_qwen3_coder_streams_string_values_as_they_come():
    parser = tool_parser("qwen3_coder", TOOLS)
    _, deltas = parser.feed("<tool_call>\n<function=get_time>\n<parameter=zone>\nEurope/")
    assert [(d.name, d.arguments) for d in deltas] == [("get_time", ""), (None, '{"zone": "Europe/')]
    _, deltas = parser.feed("Paris\n</parameter>\n</function>\n</tool_call>")
    assert [d.arguments for d in deltas] == ['Paris"}']


def test_llama3_json_only_at_the_start_or_after_the_python_tag():
    text = 'The call would be {"name": "get_time", "parameters": {}}'
    assert tool_parser("llama3_json", TOOLS).parse(text) == (text, [])
    content, calls = tool_parser("llama3_json", TOOLS).parse('{"answer": 42}')
    assert (content, calls) == ('{"answer": 42}', [])


def test_registry_knows_vllms_names():
    assert {"hermes", "qwen3_coder", "llama3_json", "mistral", "deepseek_v3", "deepseek_v31"} <= set(TOOL_PARSERS)
    for name, parser_class in TOOL_PARSERS.items():
        assert isinstance(tool_parser(name, TOOLS), parser_class)


def test_unknown_parser_name_lists_the_known_ones():
    with pytest.raises(ValueError, match="unknown tool-call parser 'pythonic'.*hermes.*qwen3_coder"):
        tool_parser("pythonic", TOOLS)


def test_required_schema_accepts_calls_of_the_tools_only():
    schema = required_schema(TOOLS)
    output = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]'
    jsonschema.validate(json.loads(output), schema)
    for wrong in ([], [{"name": "get_weather", "parameters": {"days": 3}}], [{"name": "launch", "parameters": {}}],
                  [{"name": "get_time"}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, schema)
    assert names_and_arguments(parse_required(output, TOOLS)) == [("get_weather", PARIS), ("get_time", "{}")]


def test_required_schema_moves_each_tools_defs_to_the_root():
    unit = {"enum": ["C", "F"]}
    tools = [{"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": {"unit": {"$ref": "#/$defs/unit"}}, "$defs": {"unit": unit}}}}
        for name in ("a", "b")] + [{"type": "function", "function": {"name": "bare"}}]
    schema = required_schema(tools)
    assert schema["$defs"] == {"unit": unit}
    assert "$defs" in tools[0]["function"]["parameters"], "the request's tools are left as they were"
    jsonschema.validate([{"name": "a", "parameters": {"unit": "C"}}, {"name": "bare", "parameters": {}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "b", "parameters": {"unit": "K"}}], schema)
    tools[1]["function"]["parameters"]["$defs"] = {"unit": {"enum": ["K"]}}
    with pytest.raises(ValueError, match="unit"):
        required_schema(tools)


@pytest.mark.parametrize("text", ['[{"name": "get_weather", "parameters": {"city": "Par', "[]", '{"name": "get_time"}',
                                  '[{"name": "launch", "parameters": {}}]'])
def test_parse_required_reads_nothing_from_what_is_not_such_an_array(text):
    assert parse_required(text, TOOLS) == []


def test_named_call_takes_the_whole_output_as_arguments():
    call = named_call("get_weather", ' {"city": "Paris"}\n')
    assert (call.name, call.arguments) == ("get_weather", PARIS)
    assert call.id.startswith("call_")


def test_importing_the_parsers_imports_no_torch():
    code = ("import sys, spillway.gateway.text.tool_calls; "
            "assert not {'torch', 'transformers'} & set(sys.modules), sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True)
