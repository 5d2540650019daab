"""tools/loadgen's --dataset (ShareGPT files and JSON lines of prompts), against the fake server."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_loadgen_fake import FakeServer, run_loadgen

from spillway.tools.loadgen.cli import main

DATASET = Path(__file__).parent / "data" / "sharegpt_small.json"


def test_a_sharegpt_file_is_replayed_with_its_replies_lengths(capsys, tmp_path):
    """Three usable conversations of five (one has no reply, one is empty), in a seeded order,
    cycling over six requests; each asks as many tokens as its recorded reply has (the fake
    server's /tokenize counts words)."""
    with FakeServer() as server:
        code, results, printed = run_loadgen(capsys, tmp_path, server.url, "--dataset", str(DATASET),
                                             "--num-requests", "6", "--concurrency", "2")
    assert code == 0 and results["summary"]["num_ok"] == 6
    sent = sorted((body["prompt"], body["max_tokens"]) for _, body in server.requests)
    expected = {"What is the capital of France and why is it famous": 14, "Name three primary colours": 3,
                "Explain a hash table in one sentence": 18}
    assert sent == sorted(list(expected.items()) * 2)
    assert results["config"]["workload"] == "dataset"
    assert "dataset sharegpt_small.json: 3 prompts, 2 skipped" in printed
    assert "(p90 and p99 rest on 6 samples, fewer than 20" in printed


def test_json_lines_prompts_take_their_own_or_the_given_output_length(capsys, tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('"one two three"\n{"prompt": "four five", "output_len": 2}\n\n{"other": 1}\n')
    with FakeServer() as server:
        code, _, _ = run_loadgen(capsys, tmp_path, server.url, "--dataset", str(path), "--num-requests", "2",
                                 "--output-len", "5")
        assert code == 0 and sorted(body["max_tokens"] for _, body in server.requests) == [5, 5]
        server.requests.clear()
        with pytest.raises(SystemExit) as exit_info:  # the first line gives no output length
            main(["--url", server.url, "--dataset", str(path), "--no-progress"])
    assert exit_info.value.code == 2
    assert "some prompts give no output length; add --output-len" in capsys.readouterr().err


def test_a_dataset_with_a_workload_or_nothing_usable_is_refused(capsys, tmp_path):
    empty = tmp_path / "empty.json"
    empty.write_text('[{"conversations": [{"from": "human", "value": "no reply"}]}]')
    for args, message in ((["--dataset", str(DATASET), "--workload", "multi-turn"], "leave --workload out"),
                          (["--dataset", str(empty)], "no usable prompt"),
                          (["--dataset", str(tmp_path / "missing.json")], "No such file")):
        with pytest.raises(SystemExit) as exit_info:
            main(["--url", "http://127.0.0.1:9", "--no-progress", *args])
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err
