"""tools/bench/tier/served.py's workload pieces and checks (the rows themselves run on the GPU)."""

from __future__ import annotations

import contextlib
import os
import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))

from spillway.tools.bench.tier import served  # noqa: E402
from spillway.tools.bench.tier import served_traffic  # noqa: E402


def test_each_turn_extends_the_one_before_by_a_reply_and_a_user_message():
    turns = served.conversation_turns(random.Random(0), 1000, turns=3, user_len=5, reply_len=7)
    assert [len(t) for t in turns] == [5, 17, 29]
    assert turns[1][:5] == turns[0] and turns[2][:17] == turns[1]
    assert all(256 <= token < 1000 for token in turns[2])
    first = served.conversation_turns(random.Random(0), 1000, turns=2, user_len=5, reply_len=7, first_len=30)
    assert [len(t) for t in first] == [30, 42]


def test_turns_go_round_robin_over_the_conversations():
    a, b = [[1], [1, 2]], [[3], [3, 4]]
    assert served_traffic.round_robin([a, b]) == [(0, [1]), (0, [3]), (1, [1, 2]), (1, [3, 4])]


def test_the_cpu_tier_hits_are_read_from_the_metrics_text():
    text = ('# TYPE spillway:cached_tokens counter\n'
            'spillway:cached_tokens_total{model_name="bench",source="gpu"} 12.0\n'
            'spillway:cached_tokens_total{model_name="bench",source="cpu"} 4096.0\n')
    assert served_traffic.cpu_cached_in(text) == 4096.0
    assert served_traffic.cpu_cached_in("") == 0.0


def test_the_tier_usage_and_the_bytes_stored_are_read_from_the_metrics_text():
    text = ('# TYPE vllm:cpu_cache_usage_perc gauge\n'
            'vllm:cpu_cache_usage_perc{model_name="bench"} 1.0\n'
            '# TYPE vllm:kv_offload_total_bytes counter\n'
            'vllm:kv_offload_total_bytes_total{model_name="bench",transfer_type="GPU_to_CPU"} 4096.0\n'
            'vllm:kv_offload_total_bytes_total{model_name="bench",transfer_type="CPU_to_GPU"} 512.0\n')
    assert served_traffic.tier_gauges_in(text) == (1.0, 4096.0)
    assert served_traffic.tier_gauges_in("") == (0.0, 0.0)


def test_sizes_are_checked_before_any_server_starts():
    args = served.build_parser().parse_args(["--quick", "--concurrency", "9"])
    with pytest.raises(SystemExit, match="--concurrency"):
        served.resolve_sizes(args)
    args = served.build_parser().parse_args(["--gpu-blocks", "10"])
    with pytest.raises(SystemExit, match="--prefix-len"):
        served.resolve_sizes(args)
    args = served.build_parser().parse_args([])
    served.resolve_sizes(args)
    history = args.conversations * served.history_tokens(args)
    assert history >= 3 * args.gpu_blocks * args.block_size  # the multi-turn row outgrows the pool
    assert args.max_model_len == 16384


def test_unknown_rows_are_refused():
    with pytest.raises(SystemExit):
        served.build_parser().parse_args(["--rows", "convoy,nope"])


class _Started(Exception):
    pass


@pytest.mark.parametrize("measure", [served.measure_multiturn, served.measure_convoy])
def test_each_row_starts_its_server_with_the_model_folder_and_the_tier(monkeypatch, tmp_path, measure):
    """The rows start `spillway serve` with arguments the server helper takes (no GPU needed:
    the start is stopped at once)."""
    import inspect

    from spillway.tools.bench.serve.server_process import Server

    started = []

    def fake_server(*args, **kwargs):
        inspect.signature(Server).bind(*args, **kwargs)  # TypeError if the call does not fit
        started.append(args[0])
        raise _Started

    monkeypatch.setattr(served, "Server", fake_server)
    args = served.build_parser().parse_args(["--quick", "--cpu-offload-gb", "3"])
    served.resolve_sizes(args)
    with pytest.raises(_Started):
        measure(tmp_path, 1000, ["--num-gpu-blocks-override", "32"], args)
    serve_args = started[0]
    assert str(tmp_path) in serve_args and "--num-gpu-blocks-override" in serve_args
    assert float(serve_args[serve_args.index("--cpu-offload-gb") + 1]) == 3


def test_repeated_multiturn_runs_report_their_medians():
    """Two runs of each server: the row is the median of each side's TTFT p50 (and of the
    P99 gaps), every run's TTFT p50 is in the note."""
    from spillway.tools.bench.result_rows import Rows
    from spillway.tools.bench.serve.stream_client import StreamTiming

    def run(first_token_ms: float, gap_ms: float) -> list:
        turn = StreamTiming(start=0.0, first_token_at=first_token_ms / 1e3, gaps=[gap_ms / 1e3],
                            prompt_tokens=100, cached_tokens=64)
        return [(0, StreamTiming(start=0.0, first_token_at=1.0)), (1, turn), (2, turn)]

    results = {"tier": [(run(80.0, 20.0), 128.0), (run(60.0, 30.0), 128.0), (run(70.0, 40.0), 128.0)],
               "no tier": [(run(240.0, 100.0), 0.0), (run(180.0, 90.0), 0.0), (run(300.0, 110.0), 0.0)]}
    args = served.build_parser().parse_args(["--quick"])
    served.resolve_sizes(args)
    rows = Rows(None)
    served.report_multiturn(results, args, rows)
    ttft, itl = rows.rows
    assert (ttft["value"], ttft["baseline"], ttft["ratio"]) == (70.0, 240.0, 240.0 / 70.0)
    assert "tier: 80.0, 60.0, 70.0; no tier: 240.0, 180.0, 300.0" in ttft["note"]
    assert itl["value"] == pytest.approx(30.0 - 100.0)


def test_convoy_rounds_report_the_medians_of_the_lone_request_and_of_the_convoy():
    """Three rounds: the row is the median lone TTFT against the median convoy p50, every
    round's pair is in the note."""
    from spillway.tools.bench.result_rows import Rows
    from spillway.tools.bench.serve.stream_client import StreamTiming

    def timing(ms: float) -> StreamTiming:
        return StreamTiming(start=0.0, first_token_at=ms / 1e3)

    def one_round(alone_ms: float, convoy_ms: list[float]) -> dict:
        return {"single": timing(alone_ms), "single_cpu": 9984.0, "convoy": [timing(ms) for ms in convoy_ms],
                "convoy_cpu": 9984.0, "stored": (0.0, 0.0)}

    results = {"rounds": [one_round(40.0, [44.0, 46.0, 90.0]), one_round(44.0, [50.0, 52.0, 60.0]),
                          one_round(42.0, [47.0, 48.0, 49.0])],
               "fillers": 5, "filler_len": 400, "filled": 0}
    args = served.build_parser().parse_args(["--quick", "--repeats", "3"])
    served.resolve_sizes(args)
    rows = Rows(None)
    served.report_convoy(results, args, rows)
    (convoy,) = rows.rows
    assert (convoy["value"], convoy["baseline"]) == (48.0, 42.0)
    assert convoy["ratio"] == pytest.approx(42.0 / 48.0)
    assert "40.0/46.0 (0.870), 44.0/52.0 (0.846), 42.0/48.0 (0.875)" in convoy["note"]

    # The same rounds with a second burst read by several client processes: a second row,
    # against the same lone requests.
    for round_, spread in zip(results["rounds"], ([43.0, 45.0, 47.0], [47.0, 49.0, 51.0], [44.0, 45.0, 46.0])):
        round_["spread"], round_["spread_cpu"] = [timing(ms) for ms in spread], 9984.0
    args = served.build_parser().parse_args(["--quick", "--repeats", "3", "--client-processes", "4"])
    served.resolve_sizes(args)
    rows = Rows(None)
    served.report_convoy(results, args, rows)
    convoy, spread = rows.rows
    assert (convoy["value"], spread["value"], spread["baseline"]) == (48.0, 45.0, 42.0)
    assert "4 client processes" in spread["name"] and "44.0/49.0 (0.898)" in spread["note"]
    args.client_processes = 0
    with pytest.raises(SystemExit, match="--client-processes"):
        served.resolve_sizes(args)


def test_a_baseline_tree_is_served_from_its_own_source(monkeypatch, tmp_path):
    """`--baseline DIR`: the convoy's server for DIR runs with DIR's spillway first on its path,
    and a folder that is no source tree is refused before any server starts."""
    import subprocess

    from spillway.tools.bench.serve import server_process

    tree = tmp_path / "tree"
    (tree / "worker" / "driver").mkdir(parents=True)
    (tree / "worker" / "driver" / "engine.py").write_text("WHICH = 'the baseline tree'\n")
    env = server_process.tree_env(tree)
    which = subprocess.run([sys.executable, "-c", "import spillway.worker.driver.engine as e; print(e.WHICH)"],
                           env=env, capture_output=True, text=True, check=True)
    assert which.stdout.strip() == "the baseline tree"
    assert server_process.tree_env(None) is None
    with pytest.raises(SystemExit, match="not a spillway source tree"):
        server_process.tree_env(tmp_path)

    envs = []

    def fake_server(*args, env=None, **kwargs):
        envs.append(env)
        raise _Started

    @contextlib.contextmanager
    def model_folder(*args):
        yield tmp_path, 1000

    monkeypatch.setattr(served, "Server", fake_server)
    monkeypatch.setattr(served, "temporary_model_folder", model_folder)
    with pytest.raises(_Started):
        served.main(["--quick", "--rows", "convoy", "--baseline", str(tree)])
    site = Path(envs[0]["PYTHONPATH"].split(os.pathsep)[0])  # the baseline's server starts first
    assert (site / "spillway").resolve() == tree.resolve()
    with pytest.raises(SystemExit, match="convoy row only"):
        served.resolve_sizes(served.build_parser().parse_args(["--quick", "--baseline", str(tree)]))
