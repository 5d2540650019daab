"""The gateway never imports torch; the worker is its own program (`python -m spillway.worker`),
so a plain script works and a worker never outlives its gateway."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from spillway.protocol.config import WorkerConfig, WorkerLaunch, encode_launch, read_launch


def run_python(code: str, cwd: Path | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd)


def test_the_gateway_process_never_imports_torch():
    result = run_python("""
        import sys
        import spillway.gateway.http.app
        import spillway.gateway.cli.main
        from spillway.gateway import LLM, SamplingParams
        from spillway.gateway.cli.main import build_parser, worker_config
        from spillway.protocol.local import model_files

        config, root = worker_config(build_parser().parse_args(["serve", "--max-model-len", "1024"]))
        assert (config.max_model_len, root) == (1024, "HuggingFaceTB/SmolLM2-135M-Instruct"), (config, root)
        tokenizer = model_files.load_tokenizer(model_files.resolve_model(config.model, config.load_format))
        assert tokenizer.encode("Hello") == [19556]
        print(sorted(name for name in sys.modules if name.split(".")[0] == "torch"))
    """)
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.strip() == "[]"


@pytest.mark.slow
def test_a_plain_script_without_a_main_guard_runs(tmp_path):
    script = tmp_path / "first.py"
    script.write_text('from spillway.gateway import LLM, SamplingParams\n'
                      'llm = LLM()\n'
                      'print(llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=8))[0].outputs[0].text)\n')
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600,
                            cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "RuntimeError" not in result.stderr
    assert result.stdout.strip() != ""


def _gone(pid: int) -> bool:
    """Exited (a zombie left for an init that may never reap it counts as exited)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")


@pytest.mark.parametrize("how", ["crash", "exit"])
def test_the_worker_exits_when_its_gateway_dies_even_while_loading(how):
    # os._exit skips every finalizer (a crash, a SIGKILL); a normal exit closes the worker on its way out.
    ending = "os._exit(0)" if how == "crash" else "sys.exit(0)"
    gateway = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import os, sys, time
        from spillway.gateway.link.worker_process import WorkerProcess
        from spillway.protocol.config import WorkerConfig
        worker = WorkerProcess(WorkerConfig(device="cpu"))
        print(worker.process.pid, flush=True)
        time.sleep(1.0)  # the worker is still importing torch or loading the model
        {ending}
    """)], stdout=subprocess.PIPE, text=True)
    worker_pid = int(gateway.stdout.readline())
    assert gateway.wait(60) == 0
    deadline = time.monotonic() + 30
    while not _gone(worker_pid):
        assert time.monotonic() < deadline, "the worker outlived its gateway"
        time.sleep(0.1)


def test_launch_frame_round_trips_and_leaves_the_rest_of_the_pipe(tmp_path):
    launch = WorkerLaunch(config=WorkerConfig(model="m", programmatic_launch=False), inbox="ipc://a",
                          outbox="ipc://b", parent_pid=7)
    path = tmp_path / "pipe"
    path.write_bytes(encode_launch(launch) + b"rest")
    with path.open("rb", buffering=0) as f:
        assert read_launch(f.fileno()) == launch
        assert f.read() == b"rest"


def test_kernel_switches_come_from_the_environment_into_the_config(monkeypatch):
    from spillway.gateway.cli.main import build_parser, worker_config

    parser = build_parser()
    config, _ = worker_config(parser.parse_args(["serve"]))
    assert (config.programmatic_launch, config.input_major_weights) == (True, True)
    monkeypatch.setenv("SPILLWAY_PDL", "0")
    monkeypatch.setenv("SPILLWAY_INPUT_MAJOR_WEIGHTS", "false")
    config, _ = worker_config(parser.parse_args(["worker", "--connect", "tcp://127.0.0.1:1"]))
    assert (config.programmatic_launch, config.input_major_weights) == (False, False)
