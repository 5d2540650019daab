"""`spillway bench serve` with `vllm bench serve`'s flags: translated into the load generator's
command line, refused by name where loadgen cannot follow, and run for real against the gateway
over a fake worker (the printed table and the saved JSON under vLLM's names)."""

from __future__ import annotations

import json
import subprocess

import pytest

from recording_app import Recording
from server_helpers import MODEL, fake_app, server_in_thread, spillway_command
from spillway.gateway.cli.bench_serve import loadgen_argv
from spillway.gateway.cli.main import add_other_commands, build_parser


def parse(*argv: str):
    parser = build_parser()
    add_other_commands(parser)
    return parser.parse_args(["bench", "serve", *argv])


def bench(*argv: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([*spillway_command(), "bench", "serve", *argv], capture_output=True, text=True,
                          timeout=120, cwd=cwd)


def test_vllm_flags_become_the_load_generators():
    args = parse("--host", "10.0.0.5", "--port", "9000", "--backend", "openai-chat", "--model", "m",
                 "--random-input-len", "100", "--random-output-len", "20", "--random-range-ratio", "0.5",
                 "--num-prompts", "7", "--request-rate", "3", "--burstiness", "0.5", "--max-concurrency", "2",
                 "--goodput", "ttft:500", "e2el:900", "--metric-percentiles", "50,99", "--ignore-eos",
                 "--disable-tqdm", "--seed", "4")
    assert loadgen_argv(args, api_key="k") == [
        "--url", "http://10.0.0.5:9000", "--endpoint", "chat", "--num-requests", "7", "--seed", "4",
        "--temperature", "0.0", "--ignore-eos", "--percentiles", "50,99", "--model", "m", "--api-key", "k",
        "--request-rate", "3.0", "--burstiness", "0.5", "--concurrency", "2",
        "--input-len", "50:150", "--output-len", "10:30", "--slo", "ttft=500,e2e=900", "--no-progress"]


def test_an_unbounded_rate_sends_every_prompt_at_once_and_datasets_map_to_workloads():
    args = parse("--base-url", "http://h:1/v1/", "--num-prompts", "5", "--random-prefix-len", "64")
    assert loadgen_argv(args) == [
        "--url", "http://h:1", "--endpoint", "completions", "--num-requests", "5", "--seed", "0",
        "--temperature", "0.0", "--no-ignore-eos", "--percentiles", "99", "--concurrency", "5",
        "--workload", "shared-prefix", "--num-prefixes", "1", "--prefix-len", "64",
        "--input-len", "1024", "--output-len", "128"]
    repeated = loadgen_argv(parse("--dataset-name", "prefix_repetition", "--prefix-repetition-num-prefixes", "3",
                                  "--num-prompts", "6", "--max-concurrency", "1"))
    assert repeated[repeated.index("--workload"):] == [
        "--workload", "shared-prefix", "--num-prefixes", "3", "--prefix-len", "256", "--input-len", "256",
        "--output-len", "128"]
    shared = loadgen_argv(parse("--dataset-name", "sharegpt", "--dataset-path", "s.json", "--sharegpt-output-len", "9"))
    assert shared[-4:] == ["--dataset", "s.json", "--output-len", "9"]
    custom = loadgen_argv(parse("--dataset-name", "custom", "--dataset-path", "p.jsonl", "--custom-output-len", "-1"))
    assert custom[-2:] == ["--dataset", "p.jsonl"]  # -1: the file's own lengths


@pytest.mark.parametrize("flags, message", [
    (["--dataset-name", "sonnet"], "--dataset-name sonnet: not available; use one of random, sharegpt, custom, "
                                   "prefix_repetition"),
    (["--tokenizer", "gpt2"], "--tokenizer: prompts are measured with the server's own tokenizer (/tokenize)"),
    (["--endpoint", "/v1/embeddings"], "--endpoint /v1/embeddings: only /v1/completions and /v1/chat/completions"),
    (["--dataset-name", "sharegpt"], "--dataset-name sharegpt needs --dataset-path FILE"),
    (["--top-p", "0.9"], "--top-p: the load generator does not send it"),
    (["--percentile-metrics", "ttft,foo"], "--percentile-metrics ttft,foo: choose from ttft,tpot,itl,e2el"),
    (["--metric-percentiles", "0"], "--metric-percentiles: each percentile must be in (0, 100], got '0'"),
    (["--random-range-ratio", "1.5"], "--random-range-ratio must be in [0, 1), got 1.5"),
])
def test_what_the_load_generator_cannot_do_is_refused_by_name(flags, message):
    done = bench("--port", "1", *flags)  # nothing listens there: refused before anything is sent
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == f"spillway bench serve: {message}\n"


def test_help_lists_the_vllm_flags():
    done = bench("--help")
    assert done.returncode == 0
    for flag in ("--base-url", "--endpoint", "--dataset-name", "--random-input-len", "--random-output-len",
                 "--num-prompts", "--request-rate", "--max-concurrency", "--save-result", "--result-dir"):
        assert flag in done.stdout


@pytest.fixture(scope="module")
def server(files):
    app, _ = fake_app(files, list(range(1000, 1010)))  # ten tokens, one per step; the fake stops at max_tokens
    recording = Recording(app)
    with server_in_thread(recording) as url:
        yield url, recording


def test_a_short_run_prints_and_saves_vllms_figures(server, tmp_path):
    url, recording = server
    done = bench("--base-url", url, "--model", MODEL, "--random-input-len", "16", "--random-output-len", "4",
                 "--num-prompts", "5", "--max-concurrency", "2", "--ignore-eos", "--disable-tqdm",
                 "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
                 "--save-result", "--result-dir", str(tmp_path / "out"), "--metadata", "tree=test", "--save-detailed")
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "============ Serving Benchmark Result ============"
    assert lines[1].split() == ["Successful", "requests:", "5"] and lines[2].split() == ["Failed", "requests:", "0"]
    assert lines[3].split() == ["Maximum", "request", "concurrency:", "2"]
    assert lines[4].split() == ["Request", "rate", "configured", "(RPS):", "inf"]
    assert lines[7].split() == ["Total", "generated", "tokens:", "20"]
    assert [line for line in lines if line.startswith("-")] == [
        "---------------Time to First Token----------------", "-----Time per Output Token (excl. 1st token)------",
        "---------------Inter-token Latency----------------", "----------------End-to-end Latency----------------"]
    assert "P50 ITL (ms):" in done.stdout and "P99 E2EL (ms):" in done.stdout and lines[-2] == "=" * 50

    sent = recording.bodies("/v1/completions")
    assert len(sent) == 5
    assert all((b["model"], b["max_tokens"], b["ignore_eos"], b["min_tokens"], b["stream"]) == (MODEL, 4, True, 4, True)
               for b in sent)
    (saved,) = (tmp_path / "out").iterdir()
    assert saved.name.startswith("vllm-infqps-concurrency2-SmolLM2-135M-Instruct-") and saved.suffix == ".json"
    assert lines[-1] == f"results written to {saved}"
    result = json.loads(saved.read_text())
    assert (result["completed"], result["failed"], result["total_output_tokens"]) == (5, 0, 20)
    assert (result["num_prompts"], result["max_concurrency"], result["request_rate"]) == (5, 2, "inf")
    assert (result["model_id"], result["backend"], result["tree"]) == (MODEL, "vllm", "test")
    assert result["median_ttft_ms"] > 0 and result["p99_e2el_ms"] >= result["p50_e2el_ms"] > 0
    assert sum(result["input_lens"]) == result["total_input_tokens"] > 0
    assert result["output_lens"] == [4] * 5 and len(result["ttfts"]) == 5 and result["errors"] == [""] * 5
    assert all(len(gaps) <= 3 for gaps in result["itls"])  # a gap between chunks; a chunk may carry more tokens


def test_a_sharegpt_file_is_replayed_as_chat_at_a_request_rate(server, tmp_path):
    url, recording = server
    recording.posts.clear()
    conversations = [{"conversations": [{"from": "human", "value": f"Question {i}?"}, {"from": "gpt", "value": "Yes."}]}
                     for i in range(3)]
    dataset = tmp_path / "sharegpt.json"
    dataset.write_text(json.dumps(conversations))
    done = bench("--base-url", url + "/v1", "--backend", "openai-chat", "--endpoint", "/v1/chat/completions",
                 "--dataset-name", "sharegpt", "--dataset-path", str(dataset), "--sharegpt-output-len", "3",
                 "--num-prompts", "3", "--request-rate", "50", "--disable-tqdm")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Request rate configured (RPS):           50.00" in done.stdout
    assert "Total generated tokens:                  9" in done.stdout
    sent = recording.bodies("/v1/chat/completions")
    assert sorted(b["messages"][-1]["content"] for b in sent) == ["Question 0?", "Question 1?", "Question 2?"]
    assert [(b["max_tokens"], "ignore_eos" in b) for b in sent] == [(3, False)] * 3  # vLLM's default: no ignore_eos
