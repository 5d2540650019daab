"""The body of a Ray replica's actor, without Ray: it starts the worker program with the
replica's launch on its stdin and the link's key in its environment, starts another when one is
killed, kills only the generation it is asked to, and after `stop` ends its worker and starts
none. The worker here is a stand-in program that records what it was given, then waits for its
launch pipe's end as the real one does."""

from __future__ import annotations

import json
import os
import signal
import sys
import textwrap
import time
from pathlib import Path

import msgspec
import pytest

from spillway.gateway.replicas.worker_host import MAX_RESTART_DELAY_S, WorkerHost, restart_delay
from spillway.protocol.config import WorkerConfig

STAND_IN = textwrap.dedent("""
    import json, os, sys
    from spillway.protocol.config import read_launch
    launch = read_launch(sys.stdin.fileno())
    with open(sys.argv[1], "a") as record:
        record.write(json.dumps({"pid": os.getpid(), "key": os.environ.get("SPILLWAY_WORKER_KEY"),
                                 "threads": os.environ.get("OMP_NUM_THREADS"), "inbox": launch.inbox,
                                 "outbox": launch.outbox, "parent_pid": launch.parent_pid,
                                 "kv_events": launch.config.kv_events, "model": launch.config.model}) + "\\n")
    while os.read(sys.stdin.fileno(), 4096):
        pass
""")
CONFIG = WorkerConfig(model="/models/m", served_model_name="m", kv_events=True, max_model_len=128)


@pytest.fixture
def host(tmp_path):
    program = tmp_path / "stand_in.py"
    program.write_text(STAND_IN)
    record = tmp_path / "launches"
    host = WorkerHost(msgspec.msgpack.encode(CONFIG), "tcp://192.0.2.7:6100", "tcp://192.0.2.7:6101",
                      "a secret of this run", {"OMP_NUM_THREADS": "1"},
                      command=[sys.executable, str(program), str(record)])
    yield host, record
    host.stop()


def launches(record: Path, count: int) -> list[dict]:
    deadline = time.monotonic() + 30
    while not record.exists() or len(record.read_text().splitlines()) < count:
        assert time.monotonic() < deadline, f"fewer than {count} workers started"
        time.sleep(0.02)
    return [json.loads(line) for line in record.read_text().splitlines()]


def test_the_worker_gets_the_replicas_launch_and_the_key_in_its_environment(host):
    host, record = host
    generation, pid, node = host.worker()
    (launch,) = launches(record, 1)
    assert (generation, pid) == (1, launch["pid"]) and node
    assert launch == {"pid": pid, "key": "a secret of this run", "threads": "1", "inbox": "tcp://192.0.2.7:6100",
                      "outbox": "tcp://192.0.2.7:6101", "parent_pid": os.getpid(), "kv_events": True,
                      "model": "/models/m"}
    assert b"a secret of this run" not in Path(f"/proc/{pid}/cmdline").read_bytes()


def test_a_killed_worker_is_followed_by_another(host):
    host, record = host
    _, first, _ = host.worker()
    launches(record, 1)  # it has read its launch
    os.kill(first, signal.SIGKILL)
    assert host.wait_exit(1) == -signal.SIGKILL
    generation, second, _ = host.worker()
    assert generation == 2 and second != first
    assert [launch["pid"] for launch in launches(record, 2)] == [first, second]


def test_only_the_generation_named_is_killed(host):
    host, record = host
    _, first, _ = host.worker()
    host.kill_worker(1)
    assert host.wait_exit(1) == -signal.SIGKILL
    _, second, _ = host.worker()
    host.kill_worker(1)  # the one before, long gone: the running one stays
    time.sleep(0.3)
    generation, pid, _ = host.worker()
    assert (generation, pid) == (2, second) and len(launches(record, 1)) <= 2


def test_stop_ends_the_worker_and_starts_no_other(host):
    host, record = host
    host.worker()
    launches(record, 1)
    host.stop()
    assert host.wait_exit(1) == 0  # it saw its launch pipe close
    time.sleep(1.5)  # past the restart delay
    assert len(launches(record, 1)) == 1
    with pytest.raises(RuntimeError, match="stopping"):
        host.worker()


def test_restarts_wait_longer_while_workers_keep_failing():
    assert [restart_delay(quick) for quick in range(8)] == [1, 1, 2, 4, 8, 16, MAX_RESTART_DELAY_S,
                                                             MAX_RESTART_DELAY_S]
