"""Speculation under a grammar, on the real SmolLM2: drafts are verified against the masks of
the positions they would fill, so greedy outputs equal plain decoding's whatever the drafts (n-gram
lookups, random tokens the grammar mostly refuses, the true continuation), the answers follow
their schema, and a reasoning model's thinking stays free before the constrained answer."""

from __future__ import annotations

import json

import jsonschema
import pytest

from spillway.protocol.config import SpeculativeConfig, WorkerConfig
from spillway.protocol.local import model_files
from spillway.protocol.messages import SamplingParams, StructuredKind, StructuredOutput
from spillway.protocol.reasoning import ThinkingPolicy
from spillway.worker.driver.engine import Engine
from spillway.worker.speculative.proposer import NgramProposer, ReplayProposer
from tests.worker.spec_helpers import Job, RandomProposer, run, tokens_and_reasons

K = 4
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 2}},
          "required": ["name", "age", "tags"]}


@pytest.fixture(scope="module")
def setup():
    files = model_files.resolve_model(None)
    tokenizer = model_files.load_tokenizer(files)
    engine = Engine(WorkerConfig(model=str(files.path), dtype="float32", device="cpu", max_num_seqs=8,
                                 max_model_len=512, speculative=SpeculativeConfig(method="ngram",
                                                                                num_speculative_tokens=K)))
    yield engine, tokenizer
    engine.close()


def jobs(tokenizer) -> list[Job]:
    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    schema = StructuredOutput(kind=StructuredKind.JSON, spec=json.dumps(SCHEMA))
    quoted = ids('Copy this JSON exactly: {"name": "Ada", "age": 36, "tags": ["math", "code"]}\nCopy: ')
    think = ThinkingPolicy(start_token_ids=tuple(ids("<think>")), end_token_ids=tuple(ids("</think>")), budget=6,
                           prompt_opened=True)
    return [
        Job("quoted", quoted, SamplingParams(temperature=0.0, max_tokens=60, structured=schema)),
        Job("person", ids("A person as JSON: "), SamplingParams(temperature=0.0, max_tokens=60, structured=schema)),
        Job("choice", ids("Is Paris in France? Answer: "), SamplingParams(
            temperature=0.0, max_tokens=8, structured=StructuredOutput(kind=StructuredKind.CHOICE,
                                                                       spec='["yes", "no"]'))),
        Job("thinker", ids("Think, then answer as JSON. <think>"), SamplingParams(
            temperature=0.0, max_tokens=60, structured=schema), think),
        Job("free", quoted, SamplingParams(temperature=0.0, max_tokens=20)),
    ]


@pytest.mark.parametrize("proposer_kind", ["ngram", "random", "replay"])
def test_greedy_outputs_under_a_grammar_equal_plain_decoding_whatever_the_drafts(setup, proposer_kind):
    engine, tokenizer = setup
    work = jobs(tokenizer)
    expected = run(engine, work, None)
    proposer = {"ngram": NgramProposer(1, 3), "random": RandomProposer(len(tokenizer), seed=2),
                "replay": ReplayProposer({tuple(job.prompt): expected[job.request_id].tokens for job in work})}
    before = engine.spec.metrics.num_draft_tokens
    got = run(engine, work, proposer[proposer_kind])
    assert tokens_and_reasons(got) == tokens_and_reasons(expected)
    assert engine.spec.metrics.num_draft_tokens > before
    for name in ("quoted", "person"):
        jsonschema.validate(json.loads(tokenizer.decode(got[name].tokens, skip_special_tokens=True)), SCHEMA)
    assert tokenizer.decode(got["choice"].tokens, skip_special_tokens=True) in ("yes", "no")
    thought = tokenizer.decode(got["thinker"].tokens, skip_special_tokens=True)
    answer = thought.split("</think>", 1)[1]
    jsonschema.validate(json.loads(answer), SCHEMA)
