"""`spillway serve` and an `LLM` script start and stop as vLLM's do: a port in use ends the
command before the model loads; Ctrl-C (SIGINT to the process group, as a terminal sends it)
and SIGTERM end gateway and worker within 5 s, with exit status 0 and nothing on the console
but the logs: no traceback, no "nanobind: leaked" report, no resource_tracker warning."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

from ports import listening_socket
from server_helpers import MODEL, ServerProcess, spillway_command

NOISE = ("Traceback", "leaked", "resource_tracker")


def assert_quiet(output: str) -> None:
    for word in NOISE:
        assert word not in output, output[-3000:]


def stop(process: subprocess.Popen, sig: signal.Signals, whole_group: bool) -> tuple[int, float]:
    """Send `sig` (to the process group, as a terminal's Ctrl-C, or to the process alone, as
    `kill` does); the exit status and how long the process took to end."""
    sent = time.monotonic()
    if whole_group:
        os.killpg(process.pid, sig)
    else:
        process.send_signal(sig)
    code = process.wait(30)
    return code, time.monotonic() - sent


def worker_started(pid: int) -> bool:
    """Whether process `pid` has started its worker (a child running spillway.worker)."""
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return False
    for child in children:
        try:
            if b"spillway.worker" in Path(f"/proc/{child}/cmdline").read_bytes():
                return True
        except OSError:
            continue
    return False


def test_a_port_in_use_ends_serve_at_once_naming_the_port():
    with listening_socket() as taken:
        port = taken.getsockname()[1]
        started = time.monotonic()
        result = subprocess.run([*spillway_command(), "serve", "--port", str(port)], capture_output=True, text=True,
                                timeout=30)
    assert result.returncode == 1
    assert time.monotonic() - started < 5
    assert f"port {port} is in use" in result.stderr
    assert "worker" not in result.stderr + result.stdout  # no model load began
    assert_quiet(result.stderr)


@pytest.mark.slow
@pytest.mark.parametrize("sig, whole_group", [(signal.SIGINT, True), (signal.SIGTERM, False),
                                              (signal.SIGTERM, True)],
                         ids=["ctrl-c", "sigterm", "sigterm-to-the-group"])
def test_a_signal_ends_a_serving_server_quietly(sig, whole_group):
    server = ServerProcess("--max-model-len", "512")
    try:
        server.wait_healthy()
        worker = server.worker_pid()
        reply = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=60)
        assert reply.status_code == 200
        code, took = stop(server.process, sig, whole_group)
        log = server.log()
    finally:
        server.stop()
    assert code == 0 and took < 5, log[-3000:]
    assert not Path(f"/proc/{worker}").exists()
    assert f"Spillway serves {MODEL} at {server.url}" in log
    assert_quiet(log)


@pytest.mark.slow
def test_ctrl_c_while_the_model_loads_ends_serve_quietly():
    server = ServerProcess("--max-model-len", "512")
    try:
        deadline = time.monotonic() + 60
        # The worker process exists: its imports alone take over a second, so the model is
        # still loading (a log line after 5 s of loading would come too late on a fast machine).
        while not worker_started(server.process.pid):
            assert time.monotonic() < deadline and server.process.poll() is None, server.log()
            time.sleep(0.01)
        code, took = stop(server.process, signal.SIGINT, whole_group=True)
        log = server.log()
        assert "worker ready" not in log  # stopped while loading, not after
    finally:
        server.stop()
    assert code == 0 and took < 5, log[-3000:]
    assert_quiet(log)


OFFLINE_SCRIPT = textwrap.dedent("""
    import sys
    from spillway.gateway.offline.llm import LLM
    from spillway.gateway.api.sampling_params import SamplingParams

    llm = LLM(max_model_len=512)
    try:
        print(llm.generate(["hi"], SamplingParams(max_tokens=3, temperature=0))[0].outputs[0].token_ids, flush=True)
        while sys.argv[1] == "wait":
            llm.generate(["a longer prompt to keep it busy"], SamplingParams(max_tokens=64))
    except KeyboardInterrupt:
        sys.exit(130)
""")


@pytest.mark.slow
@pytest.mark.parametrize("ending", ["normal", "ctrl-c"])
def test_an_offline_script_ends_quietly(tmp_path, ending):
    script = tmp_path / "offline.py"
    script.write_text(OFFLINE_SCRIPT)
    process = subprocess.Popen([sys.executable, str(script), "wait" if ending == "ctrl-c" else "end"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output = ""
        while not output.endswith("]\n"):  # the first generation's token ids, after the worker's logs
            line = process.stdout.readline()
            assert line, output
            output += line
        if ending == "ctrl-c":
            code, took = stop(process, signal.SIGINT, whole_group=True)
            assert code == 130 and took < 5
        else:
            assert process.wait(60) == 0
        output += process.stdout.read()
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert_quiet(output)
