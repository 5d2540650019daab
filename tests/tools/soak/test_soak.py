"""tools/soak/served.py: RSS parsing, growth and verdict on made-up samples, the traffic mix, the
answer checks, and a few seconds of soak against the gateway with a fake worker."""

from __future__ import annotations

import json
import os
import random
import sys
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "gateway"))

from fake_worker import FakeWorkerProcess  # noqa: E402
from server_helpers import MODEL, server_in_thread  # noqa: E402
from spillway.gateway.http.app import ServerSettings, build_app  # noqa: E402
from spillway.protocol.local import model_files
from spillway.protocol.config import WorkerConfig  # noqa: E402
from spillway.tools.soak import served  # noqa: E402
from spillway.tools.soak.memory import Sample, growth, parse_vm_rss, rss_bytes, rss_table, verdict  # noqa: E402
from spillway.tools.soak.traffic import (  # noqa: E402
    MIX, OUTPUT_TOKENS, PROMPT_WORDS, Call, Failure, check_answer, check_generation, traffic,
)

STATUS = "Name:\tpython\nVmPeak:\t  900000 kB\nVmRSS:\t  123456 kB\nRssAnon:\t  100000 kB\n"


def test_vm_rss_is_the_status_files_kilobytes_in_bytes():
    assert parse_vm_rss(STATUS) == 123456 * 1024
    with pytest.raises(ValueError, match="no VmRSS"):
        parse_vm_rss("Name:\tkthreadd\nState:\tS\n")


def test_this_process_rss_agrees_with_statm():
    resident_pages = int(Path("/proc/self/statm").read_text().split()[1])
    assert abs(rss_bytes(os.getpid()) - resident_pages * os.sysconf("SC_PAGE_SIZE")) < 4 << 20


def samples_of(sizes: list[int], step_s: float = 10.0) -> list[Sample]:
    return [Sample(i * step_s, i, (size, 1000)) for i, size in enumerate(sizes)]


def test_growth_compares_the_medians_of_the_windows_first_and_last_tenths():
    # 20 samples from 100 s on, so tenths of 2: the warm-up before and a spike in the middle
    # count for nothing; the medians are of (1000, 1010) and (1100, 1100).
    sizes = [500] * 10 + [1000, 1010] + [1050] * 7 + [5000] + [1050] * 8 + [1100, 1100]
    result = growth(samples_of(sizes), 0, since_s=100.0)
    assert (result.start_bytes, result.end_bytes, result.num_samples) == (1005, 1100, 20)
    assert result.mb == pytest.approx(95e-6) and result.percent == pytest.approx(100 * 95 / 1005)
    assert growth(samples_of(sizes), 1, since_s=0.0).percent == 0.0
    late = growth(samples_of(sizes), 0, since_s=175.0)  # 12 samples: a tenth is 1
    assert (late.start_bytes, late.end_bytes, late.num_samples) == (1050, 1100, 12)
    assert growth(samples_of(sizes), 0, since_s=290.0) is None  # one sample left


def test_the_verdict_is_flat_only_when_every_process_grew_less_than_one_percent():
    flat = [growth(samples_of([1000, 1009]), 0, 0.0), growth(samples_of([2000, 1990]), 0, 0.0)]
    assert verdict(["gateway", "worker"], flat, "2.0 to 6 min") == "flat: every process grew < 1% over 2.0 to 6 min"
    grown = [flat[0], growth(samples_of([2000, 2020]), 0, 0.0)]
    assert verdict(["gateway", "worker"], grown, "w") == "growing: worker +1.00% over w (flat is < 1%)"
    assert verdict(["gateway", "worker"], [flat[0], None], "w") == "no verdict: too few samples in w"


def test_the_rss_table_spans_the_run_and_marks_the_warm_up():
    table = rss_table(["gateway", "worker"], samples_of([1_000_000 * (i + 1) for i in range(30)]), 95.0, rows=4)
    lines = table.splitlines()
    assert lines[0].split() == ["time", "phase", "gateway", "MB", "worker", "MB", "requests"]
    assert [line.split()[0] for line in lines[1:]] == ["0.00", "1.67", "3.33", "4.83"]  # every 10th, and the last
    assert [line.split()[2] for line in lines[1:]] == ["warm-up", "measured", "measured", "measured"]
    assert lines[-1].split()[3] == "30.0"


def test_the_mix_is_seeded_weighted_and_varied():
    calls = traffic("m", [f"w{i}" for i in range(1000)], seed=7)
    drawn = [next(calls) for _ in range(3000)]
    again = traffic("m", [f"w{i}" for i in range(1000)], seed=7)
    assert drawn[:50] == [next(again) for _ in range(50)]
    counts, weights = Counter(c.kind for c in drawn), dict(MIX)
    for kind, weight in weights.items():
        expected = 3000 * weight / sum(weights.values())
        assert abs(counts[kind] - expected) < 0.25 * expected, (kind, counts[kind], expected)
    generations = [c for c in drawn if c.body and "max_tokens" in c.body and c.expect_status == 200]
    prompts = [c.body.get("prompt") or c.body["messages"][0]["content"] for c in generations]
    assert {len(p.split()) for p in prompts} >= {PROMPT_WORDS[0], PROMPT_WORDS[1]}
    assert {c.max_tokens for c in generations} == set(range(OUTPUT_TOKENS[0], OUTPUT_TOKENS[1] + 1))
    assert {c.path for c in generations} == {"/v1/chat/completions", "/v1/completions"}
    for call in drawn:
        assert (call.abort_after is not None) == (call.kind == "abort")
        assert call.stream == (call.body is not None and call.body.get("stream") is True)
        assert bool(call.stop) == (call.kind == "stop") and call.stop == tuple(call.body.get("stop", ())
                                                                               if call.body else ())
        assert call.exact_tokens == (call.kind != "stop" and call.body is not None and
                                     call.body.get("ignore_eos") is True)
        assert (call.expect_status == 400) == (call.kind == "invalid")
    assert any(c.stream for c in drawn if c.kind == "stop") and any(not c.stream for c in drawn if c.kind == "stop")


def test_answers_are_checked_against_what_was_asked():
    call = Call("completion", "POST", "/v1/completions", {}, max_tokens=5, exact_tokens=True)
    check_generation(call, "text", "length", {"completion_tokens": 5})
    for finish, usage, message in (("length", {"completion_tokens": 4}, "with ignore_eos, not 5"),
                                   ("length", {"completion_tokens": 6}, "for max_tokens 5"),
                                   ("length", None, "usage None"), ("abort", {"completion_tokens": 5}, "finish_reason")):
        with pytest.raises(Failure, match=message):
            check_generation(call, "text", finish, usage)
    stop = Call("stop", "POST", "/v1/completions", {}, max_tokens=5, stop=(".",))
    check_generation(stop, "no stop here", "stop", {"completion_tokens": 2})
    with pytest.raises(Failure, match="stop string"):
        check_generation(stop, "one. two", "stop", {"completion_tokens": 2})
    check_answer(Call("tokenize", "POST", "/tokenize"), b'{"count": 2, "tokens": [5, 6], "max_model_len": 9}')
    with pytest.raises(Failure, match="bad tokens"):
        check_answer(Call("tokenize", "POST", "/tokenize"), b'{"count": 3, "tokens": [5, 6]}')
    with pytest.raises(Failure, match="not JSON"):
        check_answer(Call("models", "GET", "/v1/models"), b"<html>")


def test_bad_flags_exit_2_naming_the_flag(capsys):
    for argv, message in ((["--minutes", "2", "--warmup-min", "2"], "--warmup-min"),
                          (["--url", "http://127.0.0.1:9"], "--url and --pids go together"),
                          (["--url", "http://x:1", "--pids", "1", "--model", "m"], "leave them out with --url"),
                          (["--pids", "1,2,3", "--url", "http://x:1"], "one or two process ids"),
                          (["--concurrency", "0"], "--concurrency must be >= 1"),
                          (["--minutes", "-1"], "must be > 0")):
        with pytest.raises(SystemExit) as exit_info:
            served.parse_args(argv)
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err


TEXT = "The cat sat on the mat, and then the dog came in. It was a fine day, the end.\n"


def test_a_short_soak_against_the_fake_worker_checks_every_kind_of_call(tmp_path, capsys):
    files = model_files.resolve_model(None)
    script = model_files.load_tokenizer(files)(TEXT, add_special_tokens=False)["input_ids"]
    config = WorkerConfig(model=str(files.path), served_model_name=MODEL, max_model_len=1024)
    workers = []

    def start_worker():
        workers.append(FakeWorkerProcess(config, script, step_s=0.002))
        return workers[-1]

    app = build_app(ServerSettings(worker=config, served_model_names=[MODEL]), start_worker)
    out = tmp_path / "soak.json"
    with server_in_thread(app) as url:
        pids = f"{os.getpid()},{workers[0].process.pid}"  # the gateway runs in this process
        code = served.main(["--url", url, "--pids", pids, "--minutes", "0.1", "--warmup-min", "0.02",
                          "--sample-s", "0.5", "--concurrency", "3", "--seed", str(random.randrange(1000)),
                          "--out", str(out)])
    printed = capsys.readouterr().out
    document = json.loads(out.read_text())
    summary = document["summary"]
    assert summary["failures"] == {}, printed
    assert set(summary["done"]) == {kind for kind, _ in MIX}, summary["done"]
    assert summary["requests"] == sum(summary["done"].values()) > 50
    assert code == (0 if summary["verdict"].startswith("flat") else 1)
    assert document["processes"] == ["gateway", "worker"]
    samples = document["samples"]
    assert 12 <= len(samples) <= 14 and samples[-1]["elapsed_s"] == pytest.approx(6.0, abs=0.3)
    assert all(len(s["rss_bytes"]) == 2 and min(s["rss_bytes"]) > 1 << 20 for s in samples)
    assert f"Requests: {summary['requests']:,} done" in printed and "Verdict: " in printed
    assert "Growth after the warm-up (0.02 to 0.1 min)" in printed
