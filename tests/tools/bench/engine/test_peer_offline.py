"""tools/bench/engine/peer_offline.py: the prompts both engines get, clear errors for a folder
that is not a model folder, and a small run of Spillway's side on the CPU."""

import json

import pytest

from spillway.tools.bench.engine.peer_offline import folder_vocab_size, make_prompts


def test_prompts_are_seeded_token_ids_of_the_asked_length_above_the_special_ids():
    prompts = make_prompts(1000, 5, 40, seed=3)
    assert prompts == make_prompts(1000, 5, 40, seed=3) != make_prompts(1000, 5, 40, seed=4)
    assert [len(p["prompt_token_ids"]) for p in prompts] == [40] * 5
    assert all(256 <= token < 1000 for p in prompts for token in p["prompt_token_ids"])


def test_the_vocabulary_comes_from_the_folders_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 49152}))
    assert folder_vocab_size(str(tmp_path)) == 49152


def test_a_folder_without_a_usable_config_is_a_clear_error(tmp_path):
    with pytest.raises(SystemExit, match="must be a folder holding config.json"):
        folder_vocab_size(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(SystemExit, match="no integer vocab_size"):
        folder_vocab_size(str(tmp_path))


def test_a_small_spillway_run_on_the_cpu_reports_its_steps(tmp_path):
    """The folder built from a built-in config, then the offline run: one JSON line whose step
    count covers the timed run only (eight requests of 8 tokens decoding side by side)."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[4] / "tools" / "bench" / "engine" / "peer_offline.py"
    built = subprocess.run([sys.executable, str(script), "--build", "smollm2-135m", "--model", str(tmp_path)],
                           capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert built.returncode == 0, built.stderr[-2000:]
    results = tmp_path / "rows.jsonl"
    done = subprocess.run([sys.executable, str(script), "--engine", "spillway", "--model", str(tmp_path / "smollm2-135m"),
                           "--num-requests", "8", "--input-len", "16", "--output-len", "8", "--kv-cache-dtype", "auto",
                           "--results", str(results)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    row = json.loads(results.read_text())
    assert (row["requests"], row["output_len"], row["preemptions"]) == (8, 8, 0)
    assert 8 <= row["steps"] <= 10 and row["output_tokens_per_step"] == round(64 / row["steps"], 1)
