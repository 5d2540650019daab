"""`spillway serve` / `spillway worker`: refused flags, and a worker on "another host" (tcp)."""

from __future__ import annotations

import os
import subprocess

import httpx
import pytest

from ports import reserve_ports
from server_helpers import MODEL, ServerProcess, spillway_command
from spillway.gateway.cli.main import main

REFUSED = [
    (["--swap-space", "4"], "--swap-space"),
]


@pytest.mark.parametrize("flags, named", REFUSED, ids=[r[1] + " " + " ".join(r[0][1:]) for r in REFUSED])
def test_flags_for_missing_features_are_refused(capsys, flags, named):
    assert main(["serve", *flags]) == 2
    error = capsys.readouterr().err
    assert named in error and "does not have yet" in error


@pytest.mark.parametrize("flags, numbers", [
    (["-tp", "2", "--load-format", "dummy"], "2 and the model's 3 KV heads do not divide one another"),  # SmolLM2
    (["-tp", "3", "qwen3-0.6b", "--load-format", "dummy"],  # 16 heads, 8 KV heads, intermediate 3072
     "3 does not divide the model's 16 attention heads; 3 and the model's 8 KV heads"),
])
def test_tensor_parallel_sizes_the_model_cannot_split_exit_2(capsys, flags, numbers):
    assert main(["serve", "--port", "0", *flags]) == 2
    error = capsys.readouterr().err
    assert f"--tensor-parallel-size {flags[1]}: " in error and numbers in error


def test_a_tensor_parallel_size_the_model_splits_reaches_the_worker_config():
    from spillway.gateway.cli.main import build_parser, worker_config

    args = build_parser().parse_args(["serve", "qwen3-0.6b", "--load-format", "dummy", "-tp", "2",
                                      "--speculative-draft-tensor-parallel-size", "2", "--cpu-offload-gb", "1"])
    config = worker_config(args)[0]
    assert config.tensor_parallel_size == 2 and config.cpu_offload_gb == 1


def test_flags_that_ask_for_nothing_are_accepted(capsys):
    from spillway.gateway.cli.main import build_parser, refusals

    args = build_parser().parse_args(["serve", "--cpu-offload-gb", "0", "--tensor-parallel-size", "1",
                                      "--num-speculative-tokens", "0", "--enforce-eager"])
    assert refusals(args) == []


@pytest.mark.parametrize("flags, expected", [([], None), (["--async-scheduling"], True),
                                             (["--no-async-scheduling"], False)])
def test_async_scheduling_flag_reaches_the_worker_config(flags, expected):
    from spillway.gateway.cli.main import build_parser, worker_config

    config, _ = worker_config(build_parser().parse_args(["serve", *flags, "--enforce-eager"]))
    assert config.async_scheduling is expected and config.enforce_eager


def test_kv_cache_dtype_flag_reaches_the_worker_config(capsys):
    from spillway.gateway.cli.main import build_parser, refusals, worker_config

    parser = build_parser()
    args = parser.parse_args(["serve", "--kv-cache-dtype", "fp8"])
    assert refusals(args) == []
    assert worker_config(args)[0].kv_cache_dtype == "fp8"
    args = parser.parse_args(["worker", "--connect", "tcp://127.0.0.1:1", "--kv-cache-dtype", "fp8_e4m3"])
    assert worker_config(args)[0].kv_cache_dtype == "fp8_e4m3"
    assert worker_config(parser.parse_args(["serve"]))[0].kv_cache_dtype == "auto"
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--kv-cache-dtype", "fp16"])
    assert exit_info.value.code == 2
    assert "--kv-cache-dtype: invalid choice: 'fp16'" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["serve"], ["worker", "--connect", "tcp://127.0.0.1:1"]])
def test_settings_the_local_device_cannot_run_end_the_command_with_the_workers_reason(capsys, command):
    # serve: its worker refuses them at start (the gateway never imports torch); worker: before connecting.
    assert main([*command, "--device", "cpu", "--kv-cache-dtype", "fp8"]) == 1
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == (f"spillway {command[0]}: --kv-cache-dtype fp8: an fp8 KV cache "
                                            "needs CUDA, and the device is cpu")


def test_refusal_is_a_nonzero_exit_of_the_command():
    result = subprocess.run([*spillway_command(), "serve", "--swap-space", "2", "--enable-lora"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "--swap-space" in result.stderr and "--enable-lora" in result.stderr


@pytest.mark.parametrize("flags", [["--reasoning-config", "{not json"],
                                   ["--reasoning-config", '{"start": "<think>"}'],
                                   ["--reasoning-parser", "nonesuch"]])
def test_bad_reasoning_flags_are_refused(capsys, flags):
    try:
        code = main(["serve", *flags])
    except SystemExit as exc:  # argparse: not one of the parsers
        code = exc.code
    assert code in (1, 2)
    assert "reasoning" in capsys.readouterr().err


def test_bad_worker_address_is_refused(capsys):
    assert main(["worker", "--connect", "http://host:80"]) == 1
    assert "tcp://HOST:PORT" in capsys.readouterr().err


@pytest.mark.slow
def test_worker_on_another_host_serves_through_tcp(tmp_path):
    with reserve_ports(2) as (port, _):  # the gateway binds port and port + 1
        address = f"tcp://127.0.0.1:{port}"
        key = tmp_path / "worker.key"
        key.write_text(os.urandom(32).hex())  # the link is encrypted and authenticated (CURVE)
        server = ServerProcess("--worker-address", address, "--max-model-len", "1024", "--worker-key-file", str(key))
        worker = subprocess.Popen([*spillway_command(), "worker", "--connect", address, "--max-model-len", "1024",
                                   "--worker-key-file", str(key)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            server.wait_healthy()
            reply = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
                "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                "ignore_eos": True})
            assert reply.status_code == 200
            assert reply.json()["usage"]["completion_tokens"] == 4
        finally:
            worker.kill()
            worker.wait(10)
            server.stop()
