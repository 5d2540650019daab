"""tools/bench/serve/replicas.py: the routing row's pool sized from the workload, the servers'
flags and the loads sent, the lines and their ratios from canned loadgen documents and /metrics;
on the CPU with the default model (slow), every line of a tiny run, and no server left behind
when the tool is stopped by SIGTERM or killed outright."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from spillway.tools.bench.serve import replicas
from spillway.tools.bench.serve.replica_lines import (
    parse_engine_counters, replica_figures, routing_line, routing_summary, uniform_line, uniform_summary,
)
from spillway.tools.bench.serve.server_process import descendants, wait_gone

ROOT = Path(__file__).resolve().parents[4]
TOOL = ROOT / "tools" / "bench" / "serve" / "replicas.py"
# A run small enough for a test on two cores: 4 users of 2 short turns, 4 uniform requests.
TINY = ["--users", "4", "--turns", "2", "--input-len", "16:32", "--output-len", "4:8", "--think-time", "0.2",
        "--num-requests", "4", "--input-len-uniform", "16", "--output-len-uniform", "4"]


def options(*argv: str):
    parser = replicas.build_parser()
    args = parser.parse_args(list(argv))
    replicas.check_args(parser, args)
    return args


def test_each_pool_holds_its_share_of_every_history_with_the_chat_templates_tokens():
    args = options("--users", "10", "--turns", "4", "--input-len", "20:40", "--output-len", "10",
                   "--pool-share", "0.5")
    assert replicas.history_tokens(args, 50) == 4 * (30 + 10) + 50
    assert replicas.Pool.sized(args, 50) == replicas.Pool(blocks=66, template_tokens=50)  # ceil(0.5 * 10 * 210 / 16)
    assert replicas.routing_flags("prefix", replicas.Pool(66, 50), args) == [
        "--routing", "prefix", "--num-gpu-blocks-override", "66", "--max-model-len", "1056"]


def test_a_pool_shorter_than_the_longest_conversation_is_refused():
    args = options("--users", "1", "--turns", "4", "--input-len", "20:40", "--output-len", "10", "--pool-share", "0.5")
    with pytest.raises(SystemExit, match=r"pool \(112 tokens\) is shorter than the longest conversation \(250"):
        replicas.Pool.sized(args, 50)


def test_the_order_of_the_servers_is_reversed_every_other_round():
    assert replicas.policy_order(["prefix", "load"], 3) == [
        (0, "prefix"), (0, "load"), (1, "load"), (1, "prefix"), (2, "prefix"), (2, "load")]


def test_serve_flags_end_with_the_device_args_and_the_loads_send_everything_asked():
    args = options("--device-args", "--kv-cache-dtype fp8 --max-num-seqs 64", "--users", "8", "--concurrency", "3",
                   "--think-time", "0.5", "--turns", "3", "--input-len", "10:20", "--output-len", "5",
                   "--num-requests", "12", "--input-len-uniform", "100", "--output-len-uniform", "7")
    assert replicas.serve_args(["m"], 2, 8, args, ["--routing", "load"]) == [
        "m", "--data-parallel-size", "2", "--block-size", "16", "--max-pending-requests", "8", "--routing", "load",
        "--kv-cache-dtype", "fp8", "--max-num-seqs", "64"]
    assert replicas.multi_turn_load(args) == [
        "--workload", "multi-turn", "--num-users", "8", "--concurrency", "3", "--think-time", "0.5",
        "--num-turns", "3", "--input-len", "10:20", "--output-len", "5", "--num-requests", "24"]
    assert replicas.uniform_load(args) == [  # every request at once
        "--workload", "random", "--input-len", "100", "--output-len", "7", "--num-requests", "12", "--concurrency", "12"]
    assert options().concurrency == 24  # default: every user may have a request in flight


def test_a_built_in_config_is_served_from_its_folder_with_dummy_weights_and_a_model_as_given():
    folder = Path("/tmp/qwen3-8b")
    assert replicas.model_args(options("--model", "qwen3-8b"), folder) == [str(folder), "--load-format", "dummy"]
    assert replicas.model_args(options("--model", "/m", "--load-format", "gguf"), folder) == ["/m", "--load-format",
                                                                                                "gguf"]
    assert replicas.model_args(options(), folder) == []  # serve's default model


def test_a_baseline_policy_must_be_measured(capsys):
    with pytest.raises(SystemExit):
        options("--policies", "prefix,round-robin")
    assert "--baseline-policy load is not among --policies" in capsys.readouterr().err


METRICS = """# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1000.0
vllm:prefix_cache_queries_total{engine="1",model_name="m"} 500.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 600.0
vllm:prefix_cache_hits_total{engine="1",model_name="m"} 100.0
vllm:num_preemptions_total{engine="0",model_name="m"} 2.0
vllm:num_preemptions_total{engine="1",model_name="m"} 0.0
vllm:prompt_tokens_total{engine="0",model_name="m"} 9.0
spillway:routed_requests_total{engine="0",model_name="m",reason="prefix"} 7.0
spillway:routed_requests_total{engine="0",model_name="m",reason="load"} 1.0
spillway:routed_requests_total{engine="1",model_name="m",reason="prefix"} 0.0
spillway:routed_requests_total{engine="1",model_name="m",reason="load"} 4.0
"""


def test_each_replicas_figures_are_what_its_counters_grew_by():
    before = {"0": {"queries": 200.0, "hits": 100.0, "preemptions": 1.0, "routed_prefix": 2.0, "routed_load": 1.0}}
    after = parse_engine_counters(METRICS)
    assert after["1"] == {"queries": 500.0, "hits": 100.0, "preemptions": 0.0, "routed_prefix": 0.0,
                          "routed_load": 4.0}
    assert replica_figures(before, after) == [
        dict(engine="0", prefix_cache_queries=800, prefix_cache_hits=500, hit_rate=0.625, preemptions=1,
             routed={"load": 0, "prefix": 5}),
        dict(engine="1", prefix_cache_queries=500, prefix_cache_hits=100, hit_rate=0.2, preemptions=0,
             routed={"load": 4, "prefix": 0})]


def request(conversation: int, turn: int, ttft_s: float, prompt: int, output: int, ok: bool = True) -> dict:
    return dict(conversation=conversation, turn=turn, ok=ok, ttft_s=ttft_s if ok else None,
                prompt_tokens=prompt if ok else None, output_tokens=output if ok else None)


def document(requests: list[dict], hit_rate: float | None = 0.5, failed: int = 0) -> dict:
    return {"summary": {"num_requests": len(requests), "num_failed": failed, "output_throughput": 12.34,
                        "total_token_throughput": 56.78, "duration_s": 9.876, "ttft_ms": {"median": 123.456},
                        "server": {"prefix_cache_hit_rate": hit_rate, "num_preemptions": 3.0}},
            "requests": requests}


def test_a_routing_line_takes_turns_2_on_for_ttft_and_each_conversations_last_answer_for_its_history():
    requests = [request(0, 0, 0.5, 40, 10), request(0, 1, 0.1, 80, 10), request(0, 2, 0.9, 120, 10, ok=False),
                request(1, 0, 0.7, 30, 5), request(1, 1, 0.3, 60, 5)]
    line = routing_line("prefix", 1, document(requests, hit_rate=0.123456, failed=1), [{"engine": "0"}],
                        {"users": 2}, 64, {"machine": "m"})
    assert line == dict(row="routing", policy="prefix", round=1, users=2, histories_tokens=(80 + 10) + (60 + 5),
                        histories_per_pool=round(155 / 64, 3), requests=5, failed=1, output_tok_s=12.3,
                        total_tok_s=56.8, duration_s=9.88, prefix_cache_hit_rate=0.1235, ttft_p50_ms=200.0,
                        ttft_p50_ms_first_turn=600.0, preemptions=3.0, per_replica=[{"engine": "0"}], machine="m")


def test_the_summaries_compare_medians_over_the_rounds_with_the_baseline():
    lines = [dict(policy=policy, prefix_cache_hit_rate=rate, ttft_p50_ms=ttft, failed=0)
             for policy, rate, ttft in (("prefix", 0.6, 100.0), ("load", 0.4, 300.0), ("load", 0.3, 200.0),
                                        ("prefix", 0.8, 150.0))]
    summary = routing_summary(lines, "load", {})
    assert (summary["hit_rate"], summary["ttft_p50_ms"], summary["rounds"]) == (
        {"prefix": 0.7, "load": 0.35}, {"prefix": 125.0, "load": 250.0}, 2)
    assert (summary["hit_rate_ratio"], summary["ttft_p50_ratio"]) == ({"prefix": 2.0}, {"prefix": 2.0})
    uniform = [uniform_line(dp, 0, document([]), {"input_len": 8}, {}) for dp in (1, 2)]
    assert uniform[0]["output_tok_s"] == 12.3 and uniform[0]["ttft_p50_ms"] == 123.46
    uniform[1]["output_tok_s"] = 11.7
    assert uniform_summary(uniform, {})["ratio"] == round(11.7 / 12.3, 3)


# ---- on the CPU, the default model --------------------------------------------------------------

ROUTING_FIELDS = {"row", "policy", "round", "replicas", "users", "concurrency", "think_time_s", "turns", "input_len",
                  "output_len", "pool_blocks", "block_size", "chat_template_tokens", "histories_tokens",
                  "histories_per_pool", "requests", "failed", "output_tok_s", "total_tok_s", "duration_s",
                  "prefix_cache_hit_rate", "ttft_p50_ms", "ttft_p50_ms_first_turn", "preemptions", "per_replica",
                  "model", "machine", "date", "command"}
STAMP = {"model", "machine", "date", "command"}


@pytest.mark.slow
def test_a_tiny_run_gives_every_line_with_every_request_answered(tmp_path):
    results = tmp_path / "lines.jsonl"
    done = subprocess.run([sys.executable, str(TOOL), *TINY, "--output-dir", str(tmp_path / "runs"),
                           "--results", str(results)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = [json.loads(text) for text in results.read_text().splitlines()]
    assert [json.loads(text) for text in done.stdout.splitlines() if text.startswith("{")] == lines
    assert [(line["row"], line.get("policy") or line.get("replicas")) for line in lines] == [
        ("routing", "prefix"), ("routing", "load"), ("routing-summary", None), ("uniform", 1), ("uniform", 2),
        ("uniform-summary", None)]
    routing, uniform = lines[:2], lines[3:5]
    for line in routing:
        assert set(line) == ROUTING_FIELDS and (line["requests"], line["failed"]) == (8, 0)
        assert line["chat_template_tokens"] == 41  # the default model's: a system prompt and 2 turns' markers
        assert line["histories_per_pool"] > 1  # the histories outgrow one replica's pool
        assert 0 <= line["prefix_cache_hit_rate"] <= 1 and line["ttft_p50_ms"] > 0
        assert [r["engine"] for r in line["per_replica"]] == ["0", "1"]
        assert sum(n for r in line["per_replica"] for n in r["routed"].values()) == 8
    assert {r["routed"]["prefix"] for r in routing[1]["per_replica"]} == {0}  # load routing never follows a prefix
    for line in uniform:
        assert (line["requests"], line["failed"]) == (4, 0) and line["output_tok_s"] > 0
    summary, uniform_ratio = lines[2], lines[5]
    assert summary["hit_rate"] == {line["policy"]: line["prefix_cache_hit_rate"] for line in routing}
    assert set(summary["hit_rate_ratio"]) == {"prefix"} and summary["failed"] == 0
    assert uniform_ratio["ratio"] == round(uniform[1]["output_tok_s"] / uniform[0]["output_tok_s"], 3)
    assert all(STAMP <= set(line) for line in lines)
    kept = sorted(path.name for path in (tmp_path / "runs").iterdir())
    assert "loadgen-routing-prefix-r0.json" in kept and "server-uniform-dp2-r0.log" in kept


@pytest.mark.slow
@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGKILL], ids=lambda stop: stop.name)
def test_no_server_outlives_the_tool_stopped_while_one_starts(stop):
    tool = subprocess.Popen([sys.executable, str(TOOL), *TINY, "--rows", "uniform"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    started: list[int] = []
    try:
        server = gateway_with_worker(tool.pid)
        started += [server, *descendants(server)]
        os.kill(tool.pid, stop)
        assert tool.wait(60) == (128 + stop if stop == signal.SIGTERM else -stop)
        wait_gone(started, 30)
    finally:
        tool.kill()
        tool.wait()
        for pid in started:  # should this test fail, it leaves nothing running either
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def gateway_with_worker(tool_pid: int) -> int:
    """The `spillway serve` process the tool started, once it has started its worker."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        for pid in descendants(tool_pid):
            try:
                command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"serve" in command and descendants(pid):
                return pid
        time.sleep(0.1)
    raise AssertionError("the tool started no server with a worker within 120 s")
