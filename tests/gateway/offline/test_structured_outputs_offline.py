"""Structured outputs offline on the real SmolLM2: JSON schemas, json_object, regex, choice and
grammars followed by the answers (checked with `jsonschema` and `re`), a constrained request
beside free ones changing none of theirs, a reasoning model's thinking left free and its answer
in the schema under a thinking budget, and constraints the library refuses named in the error."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from spillway.gateway import LLM, SamplingParams, StructuredOutputsParams
from spillway.protocol.local import model_files

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                                      "population": {"type": "number"}}, "required": ["city"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}, "minItems": 1,
                                               "maxItems": 3}}, "required": ["tags"]},
    {"type": "object", "properties": {"owner": {"type": "object", "properties": {
        "first": {"type": "string"}, "last": {"type": "string"}}, "required": ["first", "last"]},
        "active": {"type": "boolean"}}, "required": ["owner", "active"]},
    {"type": "object", "properties": {"points": {"type": "array", "items": {
        "type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
        "required": ["x", "y"]}, "maxItems": 2}}, "required": ["points"]},
    {"type": "object", "properties": {"answer": {"type": "string", "const": "yes"},
                                      "score": {"type": "integer", "minimum": 0, "maximum": 10}},
     "required": ["answer", "score"]},
]
ASK = [{"role": "user", "content": "Describe a person, a city or a shape as JSON."}]


@pytest.fixture(scope="module")
def llm():
    with LLM(device="cpu", dtype="float32", max_model_len=1024, max_num_seqs=16) as llm:
        yield llm


def constrained(max_tokens: int = 96, temperature: float = 0.0, **constraint) -> SamplingParams:
    return SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=3 if temperature else None,
                          structured_outputs=StructuredOutputsParams(**constraint))


def test_answers_follow_their_json_schemas_in_one_batch(llm):
    outputs = llm.chat([ASK] * len(SCHEMAS), [constrained(json=schema) for schema in SCHEMAS], use_tqdm=False)
    for schema, output in zip(SCHEMAS, outputs):
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", completion.text
        jsonschema.validate(json.loads(completion.text), schema)


def test_sampled_answers_follow_the_schema_and_repeat_under_a_seed(llm):
    params = [constrained(json=SCHEMAS[3], temperature=1.0), constrained(json=SCHEMAS[3], temperature=1.0)]
    first, second = (o.outputs[0].text for o in llm.chat([ASK, ASK], params, use_tqdm=False))
    assert first == second
    jsonschema.validate(json.loads(first), SCHEMAS[3])


def test_n_choices_each_follow_the_schema(llm):
    params = SamplingParams(n=3, temperature=1.0, max_tokens=96, structured_outputs=StructuredOutputsParams(
        json=json.dumps(SCHEMAS[0])))
    for completion in llm.chat(ASK, params, use_tqdm=False)[0].outputs:
        jsonschema.validate(json.loads(completion.text), SCHEMAS[0])


def test_json_object_regex_choice_and_grammar(llm):
    prompts = ["Give me a JSON object about cats.", "My phone number is", "The capital of France is",
               "Answer yes or no:", "Answer yes or no:"]
    params = [constrained(json_object=True, disable_any_whitespace=True),
              constrained(regex=r"\d{3}-\d{4}"), constrained(choice=["Paris", "Lyon", "Nice"]),
              constrained(grammar='root ::= "yes" | "no"'), constrained(grammar='start: "yes" | "no"')]
    texts = [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
    obj, phone, city, ebnf, lark = texts
    assert isinstance(json.loads(obj), dict) and "\n" not in obj
    assert re.fullmatch(r"\d{3}-\d{4}", phone)
    assert city in ("Paris", "Lyon", "Nice")
    assert ebnf in ("yes", "no") and lark in ("yes", "no")


def test_a_constrained_request_leaves_its_neighbours_as_they_were(llm):
    free = SamplingParams(temperature=0.0, max_tokens=24)
    alone = [o.outputs[0].token_ids for o in llm.chat([ASK, ASK], [free, free], use_tqdm=False)]
    mixed = llm.chat([ASK, ASK, ASK], [free, constrained(json=SCHEMAS[0]), free], use_tqdm=False)
    assert [mixed[0].outputs[0].token_ids, mixed[2].outputs[0].token_ids] == alone
    assert mixed[1].outputs[0].token_ids != alone[0]


def test_ignore_eos_still_ends_where_the_grammar_does(llm):
    out = llm.generate(["Answer:"], SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True,
                                                   structured_outputs=StructuredOutputsParams(choice=["yes", "no"])),
                       use_tqdm=False)[0].outputs[0]
    assert out.text in ("yes", "no") and out.finish_reason == "stop"


@pytest.mark.parametrize("constraint, problem", [
    ({"regex": "a(b"}, "the regex constraint does not compile: Regex parsing error"),
    ({"json": {"type": "objekt"}}, 'the json constraint does not compile: Unsupported type "objekt"'),
    ({"grammar": 'root ::= "a" |'}, "the grammar constraint does not compile: EBNF parser error"),
])
def test_a_constraint_the_library_refuses_is_named(llm, constraint, problem):
    with pytest.raises(ValueError, match=re.escape(problem)):
        llm.generate(["x"], constrained(**constraint), use_tqdm=False)
    # The engine goes on serving.
    assert llm.generate(["Answer:"], constrained(choice=["a", "b"]), use_tqdm=False)[0].outputs[0].text in ("a", "b")


def test_the_wrong_shape_of_constraint_is_refused_at_construction():
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="json is not valid JSON"):
        StructuredOutputsParams(json="{")
    with pytest.raises(ValueError, match="choice must be a non-empty list"):
        StructuredOutputsParams(choice=[])


def test_thinking_stays_free_and_the_answer_follows_the_schema_under_a_budget():
    tok = model_files.load_tokenizer(model_files.resolve_model(None))
    template = tok.chat_template + "{% if add_generation_prompt %}{{ '<think>\n' }}{% endif %}"
    with LLM(device="cpu", dtype="float32", max_model_len=1024, enable_reasoning=True,
             chat_template=template) as thinker:
        params = [SamplingParams(temperature=0.0, max_tokens=120, thinking_budget=budget,
                                 structured_outputs=StructuredOutputsParams(json=SCHEMAS[0])) for budget in (0, 12)]
        outputs = [o.outputs[0] for o in thinker.chat([ASK, ASK], params, use_tqdm=False)]
        free = thinker.chat(ASK, SamplingParams(temperature=0.0, max_tokens=20, thinking_budget=12),
                            use_tqdm=False)[0].outputs[0]
    for budget, out in zip((0, 12), outputs):
        assert out.num_reasoning_tokens == budget
        jsonschema.validate(json.loads(out.content), SCHEMAS[0])
    # The thinking is the unconstrained run's, token for token: the grammar starts after it.
    assert outputs[1].reasoning_content == free.reasoning_content


def test_a_constrained_request_reads_and_fills_the_prefix_cache(llm):
    llm.reset_prefix_cache()
    params = constrained(json=SCHEMAS[1])
    first, second = (llm.chat(ASK, params, use_tqdm=False)[0] for _ in range(2))
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    assert first.num_cached_tokens == 0 and second.num_cached_tokens > 0
