"""Helpers for the server tests: a real `spillway serve` process, an in-process server for
fake-worker tests (and the app around a fake worker), and metric scraping."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import httpx
import uvicorn
from fake_worker import FakeWorkerProcess
from ports import HOST, listening_socket, reserve_ports
from prometheus_client.parser import text_string_to_metric_families

from spillway.gateway.http.app import ServerSettings, build_app
from spillway.gateway.http.http_protocol import server_config
from spillway.protocol.config import WorkerConfig

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
SHORT_MODEL = "SmolLM2-135M-Instruct"  # still accepted in requests
STARTUP_TIMEOUT_S = 600


def spillway_command() -> list[str]:
    script = Path(sys.executable).parent / "spillway"
    return [str(script)] if script.exists() else [sys.executable, "-m", "spillway.gateway.cli.main"]


class ServerProcess:
    """`spillway serve` on a reserved port (held until `stop`), its output kept in a log file.
    `command(port)` starts another server program instead (tests/gateway/fake_serve.py's);
    `preexec_fn` runs in its process before anything (a lower file-handle limit, say)."""

    def __init__(self, *args: str, command: Callable[[int], list[str]] | None = None,
                 env: dict[str, str] | None = None, preexec_fn=None) -> None:
        self._reservation = reserve_ports(1)
        (self.port,) = self._reservation.ports
        self.url = f"http://{HOST}:{self.port}"
        self._log = tempfile.NamedTemporaryFile(prefix="spillway-serve-", suffix=".log", delete=False)
        argv = command(self.port) if command else [*spillway_command(), "serve", "--port", str(self.port)]
        self.process = subprocess.Popen([*argv, *args], env=env, preexec_fn=preexec_fn,
                                        stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)

    def log(self) -> str:
        return Path(self._log.name).read_text(errors="replace")

    def wait_healthy(self, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with {self.process.returncode}:\n{self.log()[-4000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"the server was not healthy within {timeout_s} s:\n{self.log()[-4000:]}")

    def worker_pid(self) -> int:
        """The worker process: the server's child `python -m spillway.worker` (started from any
        of the server's threads, hence every task's children)."""
        children = [int(pid) for task in Path(f"/proc/{self.process.pid}/task").iterdir()
                    for pid in (task / "children").read_text().split()]
        workers = [pid for pid in children
                   if b"\0-m\0spillway.worker\0" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        assert len(workers) == 1, children
        return workers[0]

    def stop(self) -> str:
        """Stop it (SIGINT, then SIGKILL to its group after 20 s); its output."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(5)
        output = self.log()
        self._log.close()
        os.unlink(self._log.name)
        self._reservation.close()
        return output


@contextmanager
def real_server(*args: str):
    server = ServerProcess(*args)
    try:
        server.wait_healthy()
        yield server
    finally:
        server.stop()


def worker_config(files, max_model_len: int = 256) -> WorkerConfig:
    return WorkerConfig(model=str(files.path), served_model_name=MODEL, max_model_len=max_model_len)


def fake_app(files, script: list[int], *, step_s: float = 0.002, start_delay_s: float = 0.0,
             max_model_len: int = 256, beat: bool = False, stall_s: float = 0.0, **settings):
    """The server's app over fake workers that replay `script`; also returns the workers started
    (`beat`: FakeWorkerProcess's, for every worker; `stall_s`: the first worker's only)."""
    config = worker_config(files, max_model_len)
    launches = []

    def start_worker():
        if launches:
            time.sleep(start_delay_s)  # a replacement worker takes a while, as a real one does
        launches.append(FakeWorkerProcess(config, script, step_s=step_s, beat=beat,
                                          stall_s=0.0 if launches else stall_s))
        return launches[-1]

    app = build_app(ServerSettings(worker=config, served_model_names=[MODEL], **settings), start_worker)
    return app, launches


@contextmanager
def running_in_thread(server: uvicorn.Server, sock, startup_timeout_s: float = 60.0):
    """Run `server` on `sock` from a thread of this process until the block ends."""
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + startup_timeout_s
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the in-process server did not start")
            time.sleep(0.02)
        yield
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


@contextmanager
def server_in_thread(app, startup_timeout_s: float = 60.0):
    """Serve an app from a thread of this process (for fake-worker tests, or real workers the
    test reaches through the app), on a socket bound here and handed over, so no other process
    can take the port in between."""
    sock = listening_socket()
    port = sock.getsockname()[1]
    server = uvicorn.Server(server_config(app, host=HOST, port=port, loop="uvloop", log_level="warning"))
    with running_in_thread(server, sock, startup_timeout_s):
        yield f"http://{HOST}:{port}"


def kill_mid_stream(url: str, path: str, body: dict, pid_to_kill) -> tuple[list[str], float]:
    """Stream `body` to `path`; after three events SIGKILL the pid `pid_to_kill()` gives. The
    stream's remaining non-empty lines, and the seconds it took to end after the kill."""
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=120) as response:
        lines = response.iter_lines()
        received = 0
        while received < 3:
            received += next(lines).startswith("data: {")
        os.kill(pid_to_kill(), signal.SIGKILL)
        killed = time.monotonic()
        rest = [line for line in lines if line]
        return rest, time.monotonic() - killed


def scrape(url: str) -> dict[str, float]:
    """/metrics as {'name{label="value",...}': value}, summed over the model_name and engine
    labels (the whole server's figures)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items())
                              if k not in ("model_name", "engine"))
            key = f"{sample.name}{{{labels}}}" if labels else sample.name
            values[key] = values.get(key, 0.0) + sample.value
    return values


def metrics_when(server: ServerProcess, ready, timeout_s: float = 20.0) -> dict[str, float]:
    """/metrics once `ready(metrics)` holds (the worker reports when it goes idle), or as it
    stands after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        metrics = scrape(server.url)
        if ready(metrics) or time.monotonic() > deadline:
            return metrics
        time.sleep(0.2)


def sse_events(raw: bytes) -> list[str]:
    """Split an SSE body into event payloads, checking the framing as a strict client would."""
    text = raw.decode("utf-8")
    assert text.endswith("\n\n"), text[-200:]
    events = text[:-2].split("\n\n")
    for event in events:
        assert event.startswith("data: ") and "\n" not in event, event
    return [event[len("data: "):] for event in events]


def engine_values(url: str, name: str) -> dict[tuple, float]:
    """{(engine, other label values...): value} of one metric's samples on the server at `url`."""
    found = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name == name:
                labels = dict(sample.labels)
                labels.pop("model_name")
                found[(labels.pop("engine"), *labels.values())] = sample.value
    return found
