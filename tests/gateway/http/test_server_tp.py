"""`spillway serve -tp 2` on the CPU: rank 1 is killed mid-stream; the stream ends with an
error at once, the whole group (rank 0 included) is replaced, and a new request succeeds.
A rank killed while the worker is idle ends the worker too; a rank never outlives rank 0."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import httpx
import pytest

from server_helpers import kill_mid_stream, real_server
from spillway.protocol.local import model_files

sys.path.insert(0, str(Path(__file__).parents[2] / "worker"))
from tiny_models import save_tiny_qwen3  # noqa: E402


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = save_tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3"))
    tokenizer = model_files.resolve_model(None).path  # decodes the tiny model's ids (all below 384)
    with real_server(model, "-tp", "2", "--device", "cpu", "--max-model-len", "512", "--served-model-name", "tiny",
                     "--tokenizer", str(tokenizer), "--num-gpu-blocks-override", "64") as running:
        yield running


def children(pid: int) -> list[int]:
    return [int(child) for task in Path(f"/proc/{pid}/task").iterdir()
            for child in (task / "children").read_text().split()]


def rank_pid(worker_pid: int) -> int:
    ranks = [pid for pid in children(worker_pid)
             if b"\0-m\0spillway.worker.tp.rank\0" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    assert len(ranks) == 1
    return ranks[0]


def gone(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/stat").read_text().split(") ")[1].split()[0]
    except FileNotFoundError:
        return True
    return status == "Z"  # exited, not yet reaped


def wait_gone(pid: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not gone(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return gone(pid)


def test_a_killed_rank_takes_its_group_down_and_the_gateway_restarts_it(server):
    worker = server.worker_pid()
    rank = rank_pid(worker)
    body = {"model": "tiny", "prompt": [5, 6, 7, 8, 9], "max_tokens": 480, "temperature": 0, "ignore_eos": True}
    rest, stream_ended = kill_mid_stream(server.url, "/v1/completions", body, lambda: rank)

    assert stream_ended < 5.0
    assert rest[-1] == "data: [DONE]"
    assert json.loads(rest[-2][len("data: "):])["error"]["code"] == "engine_unavailable"
    assert wait_gone(worker)

    server.wait_healthy(timeout_s=120)
    new_worker = server.worker_pid()
    assert new_worker != worker and rank_pid(new_worker) != rank
    reply = httpx.post(server.url + "/v1/completions", json={**body, "max_tokens": 4}, timeout=60)
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4


def test_a_rank_killed_while_idle_ends_the_worker_and_no_rank_outlives_rank_0(server):
    server.wait_healthy(timeout_s=120)
    worker = server.worker_pid()
    os.kill(rank_pid(worker), signal.SIGKILL)  # no collective under way: rank 0's watch notices
    assert wait_gone(worker)
    server.wait_healthy(timeout_s=120)
    worker = server.worker_pid()
    rank = rank_pid(worker)
    os.kill(worker, signal.SIGKILL)
    assert wait_gone(rank)  # its stdin's EOF ends it
