"""A max_model_len past the model's trained context (its config.json's position limit, times a
rope scaling factor, as vLLM derives it) is refused before a worker starts, by `LLM` and by
the command line, each naming the setting as its user wrote it, unless
SPILLWAY_ALLOW_LONG_MAX_MODEL_LEN=1 (or vLLM's VLLM_ALLOW_LONG_MAX_MODEL_LEN=1) allows it."""

from __future__ import annotations

import json

import pytest

from spillway.gateway import LLM
from spillway.gateway.cli.main import build_parser, main, worker_config
from spillway.gateway.link.engine_args import RefusedArgument, engine_config
from spillway.protocol.model_len import TrainedLength, trained_length

SMOLLM2_REFUSAL = ("{setting} is longer than the model's context of 8192 tokens (max_position_embeddings=8192 in "
                   "its config.json), past which its positions were never trained; lower it to 8192 or less, or "
                   "set SPILLWAY_ALLOW_LONG_MAX_MODEL_LEN=1 (or VLLM_ALLOW_LONG_MAX_MODEL_LEN=1) to allow it")


@pytest.fixture(autouse=True)
def no_allowance(monkeypatch):
    for name in ("SPILLWAY_ALLOW_LONG_MAX_MODEL_LEN", "VLLM_ALLOW_LONG_MAX_MODEL_LEN"):
        monkeypatch.delenv(name, raising=False)


def test_llm_refuses_a_max_model_len_past_smollm2s_8192_positions_before_a_worker_starts(monkeypatch):
    def no_worker(*args, **kwargs):
        raise AssertionError("a worker was started")

    monkeypatch.setattr("spillway.gateway.offline.llm.EngineThread", no_worker)
    with pytest.raises(RefusedArgument) as refused:
        LLM(max_model_len=32768)
    assert str(refused.value) == SMOLLM2_REFUSAL.format(setting="LLM(max_model_len=32768)")


@pytest.mark.parametrize("command", [["serve"], ["worker", "--connect", "tcp://127.0.0.1:1"]])
def test_the_command_line_refuses_it_with_the_flag_and_exit_status_2(capsys, command):
    assert main([*command, "--max-model-len", "32768"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"spillway {command[0]}: " + SMOLLM2_REFUSAL.format(setting="--max-model-len 32768"))


@pytest.mark.parametrize("variable", ["SPILLWAY_ALLOW_LONG_MAX_MODEL_LEN", "VLLM_ALLOW_LONG_MAX_MODEL_LEN"])
def test_either_variable_allows_it_and_tells_the_worker(monkeypatch, variable):
    # Without it, the trained length itself and anything shorter are taken.
    assert engine_config(None, max_model_len=8192)[0].allow_long_max_model_len is False
    assert worker_config(build_parser().parse_args(["serve", "--max-model-len", "4096"]))[0].max_model_len == 4096
    monkeypatch.setenv(variable, "1")
    config, _ = engine_config(None, max_model_len=32768)
    assert config.max_model_len == 32768 and config.allow_long_max_model_len is True


def write_config(folder, **fields) -> str:
    folder.mkdir()
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512, "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              **fields}
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


@pytest.mark.parametrize("fields, trained", [
    ({"max_position_embeddings": 4096}, 4096),
    ({"max_position_embeddings": 4096, "rope_scaling": {"rope_type": "linear", "factor": 4.0}}, 16384),
    ({"max_position_embeddings": 4096, "rope_scaling": {"type": "dynamic", "factor": 2.0}}, 8192),
    ({"max_position_embeddings": 131072,
      "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}, 131072),
    ({"max_position_embeddings": 131072,  # a null factor: transformers derives it from the two lengths
      "rope_scaling": {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 32768}}, 131072),
    # llama3's max_position_embeddings is already the extended length.
    ({"max_position_embeddings": 131072, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, 131072),
    ({"max_position_embeddings": 4096, "rope_parameters": {"rope_type": "linear", "factor": 2.0}}, 8192),
    ({"n_positions": 1024, "max_position_embeddings": 2048}, 1024),  # the smallest limit
    ({}, 2048),  # none named: vLLM's default
])
def test_a_rope_factor_extends_the_trained_length(tmp_path, fields, trained):
    model = write_config(tmp_path / "model", **fields)
    assert engine_config(model, load_format="dummy", max_model_len=trained)[0].max_model_len == trained
    with pytest.raises(RefusedArgument, match=f"max_model_len={trained + 1}.* context of {trained} tokens"):
        engine_config(model, load_format="dummy", max_model_len=trained + 1)


def test_the_message_says_where_the_length_comes_from():
    assert trained_length({"max_position_embeddings": 4096, "rope_scaling": {"rope_type": "linear", "factor": 4.0}}
                          ) == TrainedLength(16384, "max_position_embeddings=4096 x rope factor 4")
    assert trained_length({"rope_scaling": {"rope_type": "yarn", "factor": 2.0,
                                            "original_max_position_embeddings": 8192}, "max_position_embeddings": 1}
                          ) == TrainedLength(16384, "rope_scaling original_max_position_embeddings=8192 x rope factor 2")
