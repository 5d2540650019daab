"""`spillway bench latency` and `spillway bench throughput` over the offline LLM: vLLM's flags
mapped onto `LLM(...)`, refusals before any engine starts, and one very small run of each on a
tiny random model on the CPU (what is printed, and the JSON written)."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest

from server_helpers import spillway_command
from spillway.gateway.cli.bench_offline import engine_kwargs
from spillway.gateway.cli.main import add_other_commands, build_parser
from spillway.gateway.offline.llm import LLM

TINY_MODELS = Path(__file__).parents[2] / "worker"
ENGINE = ["--device", "cpu", "--max-model-len", "64", "--num-gpu-blocks-override", "32", "--max-num-seqs", "8"]


def parse(*argv: str):
    parser = build_parser()
    add_other_commands(parser)
    return parser.parse_args(["bench", *argv])


# Processes run outside the checkout: its `kernels/` folder, first on the path of a process
# started there, would shadow the `kernels` package that transformers imports when installed.
def bench(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([*spillway_command(), "bench", *argv], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).anchor)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("tiny-qwen3")
    code = f"import sys; sys.path.insert(0, {str(TINY_MODELS)!r}); from tiny_models import save_tiny_qwen3; " \
           f"save_tiny_qwen3({str(folder)!r})"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300, cwd=folder)
    return str(folder)


def test_engine_flags_become_llm_arguments_and_latency_turns_prefix_caching_off():
    args = parse("latency", "some/model", "--dtype", "float32", "--max-num-seqs", "4", "--served-model-name", "a", "b",
                 "--kv-cache-dtype", "fp8", "--enforce-eager", "-tp", "2")
    kwargs = engine_kwargs(args)
    assert set(kwargs) <= set(inspect.signature(LLM.__init__).parameters)
    assert (kwargs["model"], kwargs["served_model_name"], kwargs["dtype"], kwargs["max_num_seqs"]) == \
        ("some/model", "a", "float32", 4)
    assert (kwargs["kv_cache_dtype"], kwargs["enforce_eager"], kwargs["tensor_parallel_size"]) == ("fp8", True, 2)
    assert kwargs["enable_prefix_caching"] is False
    assert engine_kwargs(parse("throughput", "--model", "m"))["enable_prefix_caching"] is True
    with pytest.raises(ValueError, match="two different models"):
        engine_kwargs(parse("throughput", "x", "--model", "y"))


@pytest.mark.parametrize("argv, message", [
    (["latency", "--use-beam-search"], "spillway bench latency: --use-beam-search is not available in spillway bench"),
    (["latency", "--num-iters", "0"], "spillway bench latency: --num-iters must be at least 1, got 0"),
    (["throughput", "--dataset-name", "sharegpt"], "spillway bench throughput: --dataset-name sharegpt needs "
                                                   "--dataset-path FILE"),
    (["throughput", "--disable-detokenize"], "spillway bench throughput: --disable-detokenize is not available "
                                             "in spillway bench"),
])
def test_what_the_offline_engine_cannot_do_is_refused_before_it_starts(argv, message):
    done = bench(*argv)
    assert (done.returncode, done.stdout, done.stderr) == (2, "", message + "\n")


def test_an_engine_flag_spillway_lacks_is_refused_as_serve_refuses_it():
    done = bench("throughput", "--swap-space", "4")
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith("spillway bench throughput: --swap-space 4.0 needs ")


def test_help_lists_the_vllm_flags():
    latency = bench("latency", "--help").stdout
    for flag in ("--input-len", "--output-len", "--batch-size", "--num-iters-warmup", "--num-iters", "--output-json",
                 "--max-model-len", "--gpu-memory-utilization"):
        assert flag in latency
    assert "--num-prompts" in bench("throughput", "--help").stdout


def test_latency_times_every_iteration_of_one_batch(tiny_model, tmp_path):
    out = tmp_path / "latency.json"
    done = bench("latency", tiny_model, *ENGINE, "--input-len", "8", "--output-len", "4", "--batch-size", "2",
                 "--num-iters-warmup", "1", "--num-iters", "3", "--output-json", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert len(result["latencies"]) == 3 and all(latency > 0 for latency in result["latencies"])
    assert result["avg_latency"] == pytest.approx(sum(result["latencies"]) / 3)
    assert list(result["percentiles"]) == ["10", "25", "50", "75", "90", "99"]
    assert min(result["latencies"]) <= result["percentiles"]["50"] <= max(result["latencies"])
    assert done.stdout.splitlines() == [
        "Warming up...", f"Avg latency: {result['avg_latency']} seconds", f"Std latency: {result['std_latency']} seconds",
        *(f"{q}% percentile latency: {value} seconds" for q, value in result["percentiles"].items())]


def test_throughput_counts_every_prompt_and_output_token(tiny_model, tmp_path):
    out = tmp_path / "throughput.json"
    done = bench("throughput", tiny_model, *ENGINE, "--input-len", "8", "--output-len", "4", "--num-prompts", "6",
                 "--output-json", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0].startswith("Throughput: ") and lines[0].endswith(" output tokens/s")
    assert lines[1:] == ["Total num prompt tokens:  48", "Total num output tokens:  24"]
    result = json.loads(out.read_text())
    assert (result["num_requests"], result["total_num_tokens"]) == (6, 72)
    assert result["requests_per_second"] == pytest.approx(6 / result["elapsed_time"])
    assert result["tokens_per_second"] == pytest.approx(72 / result["elapsed_time"])
