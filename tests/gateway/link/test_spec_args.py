"""The speculative-decoding settings (gateway/link/spec_args.py): flags, the JSON config and LLM
arguments become one SpeculativeConfig; bad values are refused with their name."""

from __future__ import annotations

import pytest

from spillway.gateway.cli.main import build_parser, main, worker_config
from spillway.gateway.link.spec_args import speculative_config
from spillway.protocol.config import SpeculativeConfig


@pytest.mark.parametrize("settings, expected", [
    ({}, None),
    ({"num_speculative_tokens": 0}, None),
    ({"num_speculative_tokens": 0, "speculative_draft_tensor_parallel_size": 1}, None),
    ({"speculative_config": '{"method": "ngram", "num_speculative_tokens": 3}'},
     SpeculativeConfig(method="ngram", num_speculative_tokens=3)),
    ({"speculative_config": {"prompt_lookup_max": 5, "prompt_lookup_min": 2}, "num_speculative_tokens": 4},
     SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=5)),
    ({"speculative_model": "/models/draft", "num_speculative_tokens": 5},
     SpeculativeConfig(method="draft_model", num_speculative_tokens=5, model="/models/draft")),
    ({"speculative_model": "/models/draft", "speculative_config": {"num_speculative_tokens": 2},
      "speculative_draft_tensor_parallel_size": 1},
     SpeculativeConfig(method="draft_model", num_speculative_tokens=2, model="/models/draft")),
])
def test_settings_become_one_config(settings, expected):
    assert speculative_config(**settings) == expected


def test_the_draft_takes_the_targets_tensor_parallel_size():
    config = speculative_config(speculative_model="d", num_speculative_tokens=2,
                                speculative_draft_tensor_parallel_size=2, tensor_parallel_size=2)
    assert config.draft_tensor_parallel_size == 2
    with pytest.raises(ValueError, match=r"must be 1 or the tensor parallel size \(2\), got 4"):
        speculative_config(speculative_model="d", num_speculative_tokens=2,
                           speculative_draft_tensor_parallel_size=4, tensor_parallel_size=2)


@pytest.mark.parametrize("settings, message", [
    ({"speculative_model": "d", "num_speculative_tokens": 0}, "num_speculative_tokens must be an integer of at least 1"),
    ({"speculative_config": {"method": "ngram", "num_speculative_tokens": -2}}, "at least 1, got -2"),
    ({"speculative_config": {"method": "medusa", "num_speculative_tokens": 2}}, "method must be one of"),
    ({"speculative_model": "d", "num_speculative_tokens": 2, "speculative_draft_tensor_parallel_size": 2},
     "draft tensor parallel size must be 1"),
    ({"speculative_config": "{nope"}, "is not JSON"),
    ({"speculative_config": "[1, 2]"}, "must be a JSON object"),
    ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}},
     "unknown speculative config keys ['lookahead']"),
    ({"speculative_config": {"num_speculative_tokens": 3, "model": "a"}, "speculative_model": "b"},
     "speculative model is 'b' as an argument and 'a'"),
    ({"speculative_config": {"method": "draft_model", "num_speculative_tokens": 3}}, "needs a speculative model"),
    ({"num_speculative_tokens": 3}, "needs a method"),
    ({"speculative_model": "d"}, "needs num_speculative_tokens"),
    ({"speculative_config": {"method": "ngram", "num_speculative_tokens": "3"}}, "Expected `int`"),
    ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 4,
                             "prompt_lookup_max": 2}}, "prompt_lookup_min <= prompt_lookup_max"),
])
def test_bad_settings_are_refused_by_name(settings, message):
    with pytest.raises(ValueError) as error:
        speculative_config(**settings)
    assert message in str(error.value)


def test_the_flags_reach_the_worker_config():
    args = build_parser().parse_args(["serve", "--speculative-config",
                                      '{"method": "ngram", "num_speculative_tokens": 3}', "--enforce-eager"])
    assert worker_config(args)[0].speculative == SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    assert worker_config(build_parser().parse_args(["serve"]))[0].speculative is None


def test_a_bad_flag_ends_serve_with_its_reason(capsys):
    assert main(["serve", "--device", "cpu", "--num-speculative-tokens", "0", "--speculative-model", "x"]) == 1
    assert "num_speculative_tokens must be an integer of at least 1, got 0" in capsys.readouterr().err


def test_llm_with_ngram_speculation_gives_plain_greedy_outputs_and_stops_at_a_stop_string():
    """The n-gram drafts run on past the stop string: the output still ends where it completes."""
    from spillway.gateway import LLM, SamplingParams

    prompt = "One, two, three, four. One, two, three, four. One, two,"
    free = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    stopped = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=["four."])
    outputs = []
    for settings in ({}, {"speculative_config": {"method": "ngram", "num_speculative_tokens": 4}}):
        llm = LLM(dtype="float32", device="cpu", max_model_len=512, **settings)
        try:
            outputs.append([(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason)
                            for o in (llm.generate([prompt], params)[0] for params in (free, stopped))])
        finally:
            llm.shutdown()
    assert outputs[0] == outputs[1]
    (free_ids, _, _), (stop_ids, stop_text, reason) = outputs[0]
    # " three" "," " four" "." completes the stop string, which the text leaves out.
    assert len(free_ids) == 24 and (stop_ids, stop_text, reason) == (free_ids[:4], " three, ", "stop")


def test_llm_refuses_bad_speculative_settings_before_starting_a_worker():
    from spillway.gateway import LLM

    with pytest.raises(ValueError, match="speculative method must be one of"):
        LLM(device="cpu", speculative_config={"method": "eagle", "num_speculative_tokens": 2})
