"""tools/bench/serve/peer_served.py: both engines get the same serve flags; vLLM runs with its
own path first and away from the checkout; a folder without a config is a clear error; the free
and structured rows on the default model, one server, every answer as long as asked."""

import argparse
import json
import os
import sys
from pathlib import Path

import pytest

from spillway.tools.bench.serve.peer_served import run, serve_args, server_command


def options(**overrides) -> argparse.Namespace:
    values = dict(engine="spillway", model="/models/q", vllm_path=None, load_format="dummy", num_requests=10,
                  input_len=100, output_len=50, max_num_seqs=64, kv_cache_dtype="fp8", gpu_memory_utilization=0.85,
                  seed=0, timeout=60.0, startup_timeout=60.0, output_dir=None, results=None, rows=["free"])
    return argparse.Namespace(**{**values, **overrides})


def test_both_engines_get_the_same_flags_with_room_for_prompt_and_output():
    assert serve_args(options()) == serve_args(options(engine="vllm")) == [
        "/models/q", "--load-format", "dummy", "--kv-cache-dtype", "fp8", "--max-num-seqs", "64",
        "--max-model-len", "150", "--gpu-memory-utilization", "0.85"]


def test_spillway_runs_from_here_and_vllm_from_elsewhere_with_its_path_first():
    program, env, cwd = server_command(options())
    assert program == [sys.executable, "-m", "spillway.gateway.cli.main"] and env is None and cwd is None
    program, env, cwd = server_command(options(engine="vllm", vllm_path="/opt/vsite"))
    assert program == [sys.executable, "-m", "vllm.entrypoints.cli.main"]
    assert env["PYTHONPATH"].split(os.pathsep)[0] == "/opt/vsite"
    assert cwd.is_dir() and Path.cwd() not in (cwd, *cwd.parents)


def test_a_folder_without_a_config_is_a_clear_error(tmp_path):
    with pytest.raises(SystemExit, match="must be a folder holding config.json"):
        run(options(model=str(tmp_path)))


@pytest.mark.slow
def test_free_and_structured_rows_share_a_server_and_give_every_token_asked(tmp_path):
    from spillway.protocol.local import model_files

    folder = str(model_files.resolve_model(None).path)
    lines = run(options(model=folder, load_format="auto", kv_cache_dtype="auto", num_requests=4, input_len=16,
                        output_len=6, max_num_seqs=4, startup_timeout=300.0, output_dir=str(tmp_path),
                        rows=["free", "structured"]))
    assert [(line["row"], line["failed"], line["output_tokens_per_request"]) for line in lines] == [
        ("free", 0, 6.0), ("structured", 0, 6.0)]
    assert lines[0]["startup_s"] == lines[1]["startup_s"]  # one server
    config = json.loads((tmp_path / "loadgen-spillway-structured.json").read_text())["config"]
    assert config["response_format"]["json_schema"]["schema"]["properties"]["items"]["minItems"] == 1024
    assert config["ignore_eos"] is False
    assert config["shape"]["concurrency"] == 4  # every request sent at once, not one after another
