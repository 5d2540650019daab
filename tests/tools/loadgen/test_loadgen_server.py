"""tools/loadgen against a real `spillway serve` (default model, CPU): every workload, small.

One server per module. Each workload runs once (cached by the `run` fixture) with a few
requests of a few tokens, and its numbers are checked against each other and against the
server's own counters.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))  # the repository root holds `tools`

from ports import reserve_ports  # noqa: E402
from spillway.tools.loadgen.cli import main  # noqa: E402

STARTUP_TIMEOUT_S = 600
COMMON = ["--no-progress", "--concurrency", "2", "--metrics-interval", "0.05", "--output-len", "4"]
RUNS = {
    "random": ["--num-requests", "4", "--input-len", "32", "--seed", "101"],
    "shared-prefix": ["--num-requests", "8", "--num-prefixes", "1", "--prefix-len", "128", "--input-len", "16",
                      "--seed", "102"],
    "multi-turn": ["--num-requests", "6", "--num-turns", "3", "--num-users", "2", "--input-len", "16",
                   "--seed", "103"],
    "document-qa": ["--num-requests", "8", "--document-len", "256", "--input-len", "16", "--seed", "104"],
    "reasoning": ["--num-requests", "3", "--thinking-budget", "4", "--input-len", "24", "--seed", "105"],
}


@pytest.fixture(scope="module")
def server_url():
    spillway = Path(sys.executable).parent / "spillway"
    command = [str(spillway)] if spillway.exists() else [sys.executable, "-m", "spillway.gateway.cli.main"]
    # The port stays reserved while the server runs, so nothing else takes it first.
    with reserve_ports(1) as (port,), tempfile.TemporaryFile() as log:
        url = f"http://127.0.0.1:{port}"
        # --enable-reasoning: the reasoning workload sends thinking_budget, refused without a parser.
        process = subprocess.Popen([*command, "serve", "--port", str(port), "--enable-reasoning"], stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        try:
            _wait_healthy(process, url, log)
            yield url
        finally:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(10)


def _wait_healthy(process: subprocess.Popen, url: str, log) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"spillway serve exited with {process.returncode}:\n{log.read().decode()[-4000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"spillway serve was not healthy within {STARTUP_TIMEOUT_S} s")


@pytest.fixture(scope="module")
def run(server_url, tmp_path_factory):
    """run(workload) -> its results document; each workload runs once per module."""
    done: dict[str, dict] = {}

    def run_workload(workload: str) -> dict:
        if workload not in done:
            output = tmp_path_factory.mktemp(workload) / "results.json"
            args = ["--url", server_url, "--workload", workload, *COMMON, *RUNS[workload], "--output", str(output)]
            if workload == "random":  # through the real entry point once
                finished = subprocess.run([sys.executable, "-m", "tools.loadgen", *args], cwd=REPO,
                                          capture_output=True, text=True, timeout=600)
                assert finished.returncode == 0, finished.stdout + finished.stderr
                assert "4 ok, 0 failed, 4 sent" in finished.stdout
            else:
                assert main(args) == 0
            done[workload] = json.loads(output.read_text())
        return done[workload]

    return run_workload


@pytest.mark.parametrize("workload", list(RUNS))
def test_every_request_is_accounted_for_and_the_numbers_agree(run, workload):
    results = run(workload)
    summary, records, config = results["summary"], results["requests"], results["config"]
    asked = int(RUNS[workload][RUNS[workload].index("--num-requests") + 1])
    assert config["prompt_source"].startswith("corpus text")  # the server's /tokenize measured the prompts
    assert summary["num_requests"] == summary["num_ok"] == len(records) == asked and summary["errors"] == {}
    assert [r["index"] for r in records] == list(range(asked))
    for r in records:
        assert r["ok"] and r["usage_reported"]
        assert r["output_tokens"] == r["expected_output_tokens"] == 4  # ignore_eos + min_tokens honoured
        assert 1 <= r["num_chunks"] <= r["output_tokens"]
        assert 0 < r["ttft_s"] <= r["e2e_s"] and len(r["itl_s"]) == r["num_chunks"] - 1
        assert r["prompt_tokens"] >= r["expected_prompt_tokens"]
        if config["endpoint"] == "completions":  # only the "\n\n" joins are added to the measured text
            assert r["prompt_tokens"] <= r["expected_prompt_tokens"] + 2
    server = summary["server"]
    assert server["generation_tokens"] == summary["total_output_tokens"] == 4 * asked
    assert server["prompt_tokens"] == summary["total_prompt_tokens"]
    assert server["prefix_cache_queries"] == summary["total_prompt_tokens"]
    assert server["prefix_cache_hit_rate"] == pytest.approx(summary["cached_prompt_fraction"], abs=0.02)
    assert server["kv_cache_usage_peak"] > 0 and server["gpu_cache_usage_peak"] > 0
    assert server["num_preemptions"] == 0


def test_shared_prefix_hits_the_prefix_cache_and_random_does_not(run):
    random_rate = run("random")["summary"]["server"]["prefix_cache_hit_rate"]
    shared_rate = run("shared-prefix")["summary"]["server"]["prefix_cache_hit_rate"]
    document_rate = run("document-qa")["summary"]["server"]["prefix_cache_hit_rate"]
    assert random_rate < 0.1
    # The first two requests (two in flight) compute the shared text; the other six hit it.
    assert shared_rate > random_rate + 0.4 and document_rate > random_rate + 0.4


def test_multi_turn_history_grows_and_is_found_in_the_cache(run):
    records = run("multi-turn")["requests"]
    for conversation in (0, 1):
        turns = sorted((r for r in records if r["conversation"] == conversation), key=lambda r: r["turn"])
        assert [r["turn"] for r in turns] == [0, 1, 2]
        for before, after in itertools.pairwise(turns):
            # the history holds the previous prompt and its 4-token reply, plus a new 16-token message;
            # the previous prompt is a prefix of this one, so its full 16-token blocks are cache hits
            assert after["prompt_tokens"] > before["prompt_tokens"] + 16
            assert after["cached_tokens"] >= 16 * (before["prompt_tokens"] // 16)
            assert after["start_s"] >= before["start_s"] + before["e2e_s"]


# An array of at least 200 words cannot close within 6 tokens: every answer runs to its length.
LONG_SCHEMA = {"type": "object", "properties": {"words": {"type": "array", "minItems": 200,
                                                          "items": {"type": "string", "minLength": 4}}},
               "required": ["words"]}


def test_json_schema_holds_every_answer_and_a_refused_one_is_a_4xx(server_url, tmp_path):
    schema, output = tmp_path / "schema.json", tmp_path / "results.json"
    schema.write_text(json.dumps(LONG_SCHEMA))
    base = ["--url", server_url, "--no-progress", "--concurrency", "2", "--num-requests", "4", "--input-len", "16",
            "--output-len", "6", "--endpoint", "chat", "--no-ignore-eos", "--seed", "106"]
    assert main([*base, "--json-schema", str(schema), "--output", str(output)]) == 0
    results = json.loads(output.read_text())
    assert results["config"]["response_format"]["json_schema"]["schema"] == LONG_SCHEMA
    assert results["summary"]["num_ok"] == 4 and results["summary"]["errors"] == {}
    assert [r["output_tokens"] for r in results["requests"]] == [6] * 4
    schema.write_text(json.dumps({"type": "objekt"}))
    assert main([*base, "--json-schema", str(schema), "--output", str(output)]) == 1  # nothing succeeded
    results = json.loads(output.read_text())
    assert results["summary"]["errors"] == {"http_4xx": 4}  # refused before the stream starts
    assert all("objekt" in r["error"] for r in results["requests"])
