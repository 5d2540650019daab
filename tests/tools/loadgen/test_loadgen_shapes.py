"""Workload structure, load shapes, reproducibility, --compare and --plot, against the fake server."""

from __future__ import annotations

import itertools
import json
from collections import defaultdict

import pytest
from test_loadgen_fake import FakeServer, run_loadgen

from spillway.tools.loadgen.cli import build_parser, main, workload_spec
from spillway.tools.loadgen.corpus import stdlib_words
from spillway.tools.loadgen.runner import arrival_gaps
from spillway.tools.loadgen.workloads import DOCUMENT_LEAD, QUESTION_LEAD, Planner


def test_multi_turn_sends_each_turn_after_the_last_with_the_servers_replies_in_the_history(capsys, tmp_path):
    with FakeServer(ttfts_s=[0.05], itls_s=[0.01]) as server:
        code, results, _ = run_loadgen(capsys, tmp_path, server.url, "--workload", "multi-turn", "--num-turns", "3",
                                       "--num-users", "2", "--num-requests", "6", "--concurrency", "2",
                                       "--input-len", "12", "--output-len", "3")
        requests = list(server.requests)
    assert code == 0 and all(path == "/v1/chat/completions" for path, _ in requests)
    by_user = defaultdict(list)
    for _, body in requests:
        by_user[body["messages"][0]["content"]].append(body["messages"])
    assert sorted(len(turns) for turns in by_user.values()) == [3, 3]
    for turns in by_user.values():
        for k, messages in enumerate(turns):
            assert [m["role"] for m in messages] == ["user", "assistant"] * k + ["user"]
            assert all(m["content"] == " t0 t1 t2" for m in messages[1::2])  # the server's own reply
            assert messages[:-1] == (turns[k - 1] + [messages[2 * k - 1]] if k else [])
    records = results["requests"]
    for conversation in (0, 1):
        turns = sorted((r for r in records if r["conversation"] == conversation), key=lambda r: r["turn"])
        assert [r["turn"] for r in turns] == [0, 1, 2]
        for before, after in itertools.pairwise(turns):
            assert after["start_s"] >= before["start_s"] + before["e2e_s"]


def test_a_user_who_thinks_lets_the_slot_serve_another_user_and_sends_the_next_turn_after_the_wait(capsys,
                                                                                                      tmp_path):
    args = ["--workload", "multi-turn", "--num-turns", "3", "--num-users", "2", "--num-requests", "6",
            "--concurrency", "1", "--input-len", "12", "--output-len", "3"]
    with FakeServer(ttfts_s=[0.02], itls_s=[0.01]) as server:
        _, at_once, _ = run_loadgen(capsys, tmp_path, server.url, *args)
        code, thinking, printed = run_loadgen(capsys, tmp_path, server.url, *args, "--think-time", "0.2")
    assert code == 0 and "think time 0.2 s" in printed
    assert [r["conversation"] for r in at_once["requests"]] == [0, 0, 0, 1, 1, 1]  # one slot, one user at a time
    assert [r["conversation"] for r in thinking["requests"]][:2] == [0, 1]  # user 0 thinks: the slot opens user 1
    spec = workload_spec(build_parser().parse_args(["--url", "x", *args, "--think-time", "0.2"]))
    planner = Planner(spec, len(stdlib_words()))
    waits = {c: planner.plan().think_s for c in (0, 1)}
    for conversation in (0, 1):
        turns = sorted((r for r in thinking["requests"] if r["conversation"] == conversation), key=lambda r: r["turn"])
        for before, after in itertools.pairwise(turns):
            replied = before["start_s"] + before["e2e_s"]
            assert after["start_s"] >= replied + waits[conversation][after["turn"]] - 0.005  # the timer's grain


def test_think_time_is_refused_for_single_turn_workloads(capsys):
    with pytest.raises(SystemExit):
        main(["--url", "http://127.0.0.1:9", "--workload", "random", "--think-time", "1"])
    assert "--workload multi-turn only" in capsys.readouterr().err


def test_reasoning_sends_the_thinking_budget_and_times_the_first_reasoning_token(capsys, tmp_path):
    with FakeServer(ttfts_s=[0.2], itls_s=[0.02]) as server:
        code, results, _ = run_loadgen(capsys, tmp_path, server.url, "--workload", "reasoning", "--thinking-budget",
                                       "2", "--num-requests", "3", "--concurrency", "3", "--output-len", "4")
        bodies = [body for _, body in server.requests]
    assert code == 0
    assert [b["thinking_budget"] for b in bodies] == [2, 2, 2] and all("messages" in b for b in bodies)
    for record in results["requests"]:
        assert record["reasoning_tokens"] == 2 and record["output_tokens"] == 4
        # The empty role chunk, sent at once, does not count: the first token comes after 0.2 s.
        # Only late is possible beyond the 10% band: a loaded 2-core machine delayed one by 50 ms.
        assert 0.9 * 0.2 <= record["ttft_s"] <= 0.2 + 0.1


def test_shared_prefix_and_document_qa_prompts_share_their_prefix(capsys, tmp_path):
    prompts = {}
    for workload, extra in (("shared-prefix", ["--num-prefixes", "2", "--prefix-len", "30"]),
                            ("document-qa", ["--document-len", "60"])):
        with FakeServer() as server:
            code, _, _ = run_loadgen(capsys, tmp_path, server.url, "--workload", workload, "--num-requests", "8",
                                     "--concurrency", "4", "--input-len", "10", "--output-len", "2", *extra)
            prompts[workload] = [body["prompt"] for _, body in server.requests]
        assert code == 0
    prefixes = {p.split("\n\n" + QUESTION_LEAD)[0] for p in prompts["shared-prefix"]}
    assert len(prefixes) == 2 and all(len(p.split()) == 30 for p in prefixes)
    documents = {p.split("\n\n" + QUESTION_LEAD)[0] for p in prompts["document-qa"]}
    assert len(documents) == 1 and documents.pop().startswith(DOCUMENT_LEAD.strip())
    assert len({p.split(QUESTION_LEAD)[1] for p in prompts["document-qa"]}) == 8  # different questions


def test_the_same_seed_sends_the_same_requests_and_another_seed_does_not(capsys, tmp_path):
    def bodies(seed: str) -> list[str]:
        with FakeServer() as server:
            run_loadgen(capsys, tmp_path, server.url, "--num-requests", "6", "--concurrency", "3", "--seed", seed,
                        "--input-len", "5:50", "--output-len", "1:4")
            return sorted(json.dumps(body, sort_keys=True) for _, body in server.requests)

    assert bodies("11") == bodies("11")
    assert set(bodies("11")).isdisjoint(bodies("12"))


def test_request_rate_sends_at_the_seeded_arrival_times(capsys, tmp_path):
    with FakeServer() as server:
        code, results, _ = run_loadgen(capsys, tmp_path, server.url, "--request-rate", "20", "--num-requests", "20",
                                       "--input-len", "5", "--output-len", "2", "--seed", "4")
    assert code == 0
    expected = list(itertools.accumulate(itertools.islice(arrival_gaps(20, 1.0, 4), 20)))
    for record, arrival in zip(results["requests"], expected):
        assert abs(record["start_s"] - arrival) < 0.05, (record["start_s"], arrival)


def test_duration_stops_new_requests_and_the_run_ends_by_itself(capsys, tmp_path):
    with FakeServer(ttfts_s=[0.1]) as server:
        code, results, _ = run_loadgen(capsys, tmp_path, server.url, "--duration", "1", "--concurrency", "2",
                                       "--input-len", "5", "--output-len", "2")
    records = results["requests"]
    assert code == 0 and 6 <= len(records) <= 20
    assert all(r["start_s"] < 1.0 for r in records) and all(r["ok"] for r in records)
    assert results["summary"]["duration_s"] < 1.5


def test_compare_prints_two_runs_side_by_side_with_ratios_and_plot_draws_a_png(capsys, tmp_path):
    paths = []
    for name, ttft in (("a", 0.05), ("b", 0.10)):
        with FakeServer(ttfts_s=[ttft], itls_s=[0.01]) as server:
            plot = tmp_path / f"{name}.png"
            code = main(["--url", server.url, "--no-progress", "--num-requests", "4", "--concurrency", "2",
                         "--input-len", "5", "--output-len", "3", "--output", str(tmp_path / f"{name}.json"),
                         "--plot", str(plot)])
        assert code == 0 and plot.read_bytes().startswith(b"\x89PNG") and plot.stat().st_size > 20_000
        paths.append(str(tmp_path / f"{name}.json"))
    capsys.readouterr()
    assert main(["--compare", *paths]) == 0
    printed = capsys.readouterr().out
    assert "B / A" in printed and "Request throughput (req/s)" in printed
    ttft_row = next(line for line in printed.splitlines() if line.startswith("TTFT median"))
    assert 1.6 < float(ttft_row.split()[-1]) < 2.4  # B's TTFT is twice A's
    (tmp_path / "bad.json").write_text("{}")
    assert main(["--compare", paths[0], str(tmp_path / "bad.json")]) == 2
