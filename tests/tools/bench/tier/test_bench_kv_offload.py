"""tools/bench/tier/kv_offload.py without a GPU: its flags, which rows run and in what order, and the
message it stops with on a machine without CUDA."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(ROOT))

from spillway.tools.bench.tier import kv_offload  # noqa: E402
from spillway.tools.bench.tier.kv_offload import parse_args  # noqa: E402


def test_every_row_runs_by_default_with_the_defaults_of_the_h200_figures():
    args = parse_args([])
    assert args.rows == ("copies", "both", "interference", "reload")
    assert (args.model, args.blocks, args.decode_batch, args.prefix_tokens, args.chunk_tokens) == (
        "qwen3-8b", 2048, 64, 32768, 8192)


def test_a_block_is_the_models_layers_of_keys_and_values():
    assert kv_offload.block_shape(parse_args(["--model", "smollm2-135m"])) == (30, 2, 16, 3, 64)
    assert kv_offload.block_shape(parse_args(["--block-size", "32"])) == (36, 2, 32, 8, 128)


def test_rows_are_taken_in_the_order_given_once_each():
    assert parse_args(["--rows", "reload, both,reload"]).rows == ("reload", "both")
    assert parse_args(["--rows", "interference", "--prefix-tokens", "4096"]).prefix_tokens == 4096


@pytest.mark.parametrize("argv, message", [
    (["--rows", "copies,bogus"], "argument --rows: unknown rows 'bogus' (choose from copies,both,interference,reload)"),
    (["--rows", ","], "argument --rows: no rows given"),
    (["--blocks", "0"], "argument --blocks: must be at least 1, got 0"),
    (["--prefix-tokens", "32k"], "argument --prefix-tokens: not an integer: '32k'"),
    (["--paced-load-gb-s", "40,fast"], "argument --paced-load-gb-s: not comma-separated numbers: '40,fast'"),
    (["--paced-load-gb-s", "40,0"], "argument --paced-load-gb-s: rates must be positive GB/s, got '40,0'"),
])
def test_a_bad_flag_exits_2_naming_it(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_main_runs_the_selected_rows_in_order_and_prints_their_table(monkeypatch, capsys):
    ran = []

    def fake_row(name):
        def run(args, rows):
            ran.append((name, args.blocks))
            rows.add(kv_offload.row(f"{name} row", 1.5, "GB/s"))
        return run

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(kv_offload, "machine", lambda: "a test machine")
    monkeypatch.setattr(kv_offload, "BENCHMARKS",
                        {name: fake_row(name) for name in kv_offload.ROW_NAMES})
    kv_offload.main(["--rows", "reload,copies", "--blocks", "64"])
    assert ran == [("reload", 64), ("copies", 64)]
    table = capsys.readouterr().out.split("\n\n")[-1].splitlines()
    assert table[0].startswith("benchmark")
    assert [line.split()[0] for line in table[1:]] == ["reload", "copies"]


def test_without_cuda_it_stops_with_a_message(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="tools/bench/tier/kv_offload.py needs a CUDA GPU"):
        kv_offload.main(["--rows", "both"])
