"""tools/bench/grammar/backends.py: its 50-property schema is what it says, the documents it walks
the matchers through are valid instances of it, and its feature probes' valid and invalid
documents are what they claim (checked with `jsonschema`). The adapter of xgrammar, the library
Spillway runs (the others are the bench's comparison only), accepts a valid document and refuses
a wrong one on the default model's tokenizer."""

from __future__ import annotations

import json
import random

import pytest

from spillway.tools.bench.grammar import backends

def test_large_schema_has_50_mixed_properties_half_required():
    schema = backends.large_schema()
    props = schema["properties"]
    assert len(props) == 50
    assert len(schema["required"]) == 25 and set(schema["required"]) <= set(props)
    kinds = {p.get("type") for p in props.values()}
    assert kinds == {"string", "integer", "number", "boolean", "object", "array"}
    assert any("enum" in p for p in props.values())
    assert any(p["type"] == "array" and p["items"]["type"] == "object" for p in props.values())


@pytest.mark.parametrize("seed", range(8))
def test_documents_keep_required_keys_in_schema_order(seed):
    schema = backends.large_schema()
    doc = json.loads(backends.document(seed))
    order = list(schema["properties"])
    assert set(schema["required"]) <= set(doc)
    assert list(doc) == [name for name in order if name in doc]


def test_documents_are_valid_instances():
    import jsonschema

    validator = jsonschema.Draft202012Validator(backends.large_schema())
    for seed in range(64):
        validator.validate(json.loads(backends.document(seed)))
    small = jsonschema.Draft202012Validator(backends.small_schema())
    small.validate(backends.instance(backends.small_schema(), random.Random(0)))


def test_keyword_probes_say_what_is_valid():
    import jsonschema

    probes, defs = backends.keyword_probes()
    checker = jsonschema.FormatChecker()
    for keyword, (sub, valid, invalid) in probes.items():
        validator = jsonschema.Draft202012Validator(backends.keyword_schema(sub, defs), format_checker=checker)
        for value in valid:
            assert validator.is_valid(json.loads('{"x": %s}' % value)), (keyword, value)
        fmt = sub.get("format")
        if fmt is None or fmt in checker.checkers:
            for value in invalid:
                assert not validator.is_valid(json.loads('{"x": %s}' % value)), (keyword, value)


def test_the_xgrammar_adapter_accepts_a_valid_document_and_refuses_a_wrong_type():
    tok = backends.default_tokenizer()
    lib = backends.ADAPTERS["xgrammar"](1)
    lib.setup(tok)
    compiled = lib.compile("json_schema", backends.small_schema())
    assert backends.accepts(lib, compiled, tok, '{"name": "a \\"b\\"", "age": 7, "member": true}')
    assert not backends.accepts(lib, compiled, tok, '{"name": "a", "age": "7", "member": true}')
    bitmask = backends.new_bitmask(2, len(tok))
    lib.fill(lib.matcher(compiled), bitmask, 1)
    assert backends.allowed(bitmask, 1, backends.token_of(tok, "{"))
    assert not backends.allowed(bitmask, 1, backends.token_of(tok, "a"))
