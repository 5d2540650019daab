"""Two replicas behind one server, each a fake worker (tests/gateway/fake_worker.py, reporting
the prompt blocks it holds as KvEvents) that writes each request's arrival to a file of its own,
so a test sees where requests went: a conversation's turns stay on one replica by prefix and
alternate in turn; a hot prefix spreads once its replica is loaded; a replica killed mid-stream
ends its streams with an error while the other answers, and it comes back; a request its dying
replica had not started goes to the other."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from fake_worker import FakeWorkerProcess
from server_helpers import MODEL, kill_mid_stream, server_in_thread
from spillway.gateway.http.app import ServerSettings, build_app
from spillway.protocol.config import WorkerConfig
from spillway.protocol.local import model_files

BLOCK = 16


class Replicas:
    """The app's two fake workers' factories, each replica's arrivals file, and its pids."""

    def __init__(self, folder: Path, steps: tuple[float, float], holds: tuple[float, float], max_num_seqs: int):
        self.files = [folder / f"arrivals-{r}" for r in range(2)]
        self.config = WorkerConfig(model=str(model_files.resolve_model(None).path), served_model_name=MODEL, max_model_len=512,
                                   max_num_seqs=max_num_seqs, kv_events=True)
        self.steps, self.holds = steps, holds

    def starts(self):
        return [lambda r=r: FakeWorkerProcess(self.config, list(range(100, 164)), step_s=self.steps[r],
                                              hold_s=self.holds[r], beat=True, arrivals_path=str(self.files[r]))
                for r in range(2)]

    def counts(self) -> list[int]:
        return [len(f.read_text().splitlines()) if f.exists() else 0 for f in self.files]


def serve(tmp_path, routing: str, steps=(0.002, 0.002), holds=(0.0, 0.0), max_num_seqs: int = 8):
    replicas = Replicas(tmp_path, steps, holds, max_num_seqs)
    settings = ServerSettings(worker=replicas.config, served_model_names=[MODEL], data_parallel_size=2,
                              routing=routing)
    app = build_app(settings, replicas.starts())
    return app, replicas


def complete(url: str, prompt: list[int], max_tokens: int = 4, **fields) -> dict:
    reply = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
                                                      **fields}, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()


def turns(first: int) -> list[list[int]]:
    """A conversation's three prompts, each the one before plus two blocks."""
    return [list(range(first, first + BLOCK * 2 * k)) for k in (1, 2, 3)]


@pytest.mark.parametrize("routing, expected", [("prefix", "one replica"), ("round-robin", "alternating")])
def test_a_conversations_turns_stay_on_one_replica_by_prefix(tmp_path, routing, expected):
    app, replicas = serve(tmp_path, routing)
    with server_in_thread(app) as url:
        places = []
        for prompt in turns(1000):
            before = replicas.counts()
            complete(url, prompt)
            places.append([a - b for a, b in zip(replicas.counts(), before)].index(1))
    if expected == "one replica":
        assert len(set(places)) == 1
    else:
        assert places in ([0, 1, 0], [1, 0, 1])


def test_a_hot_prefix_spreads_once_its_replica_is_loaded(tmp_path):
    # max_num_seqs 4: a prefix's replica may carry one request more than the other (the slack).
    app, replicas = serve(tmp_path, "prefix", steps=(0.02, 0.02), max_num_seqs=4)
    prefix = list(range(2000, 2000 + BLOCK * 4))
    with server_in_thread(app) as url:
        threads = [threading.Thread(target=complete, args=(url, prefix + [k], 30)) for k in range(6)]
        for thread in threads:
            thread.start()
            time.sleep(0.05)  # arrivals in order: each sees the loads the ones before left
        for thread in threads:
            thread.join(60)
    counts = replicas.counts()
    assert sum(counts) == 6 and min(counts) >= 2, counts


def _pids(app) -> list[int]:
    return [replica.link.worker_pid for replica in app.state.gateway.client.replicas]


def test_a_replica_killed_mid_stream_ends_its_streams_and_the_server_keeps_answering(tmp_path):
    app, replicas = serve(tmp_path, "prefix", steps=(0.02, 0.02))
    with server_in_thread(app) as url:
        prompt = list(range(3000, 3000 + BLOCK * 2))
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 40}
        started = {}

        def pid_of_the_replica_serving():
            counts = replicas.counts()
            started["replica"] = counts.index(1)
            return _pids(app)[started["replica"]]

        rest, seconds = kill_mid_stream(url, "/v1/completions", body, pid_of_the_replica_serving)
        assert any('"error"' in line for line in rest) and rest[-1] == "data: [DONE]" and seconds < 10
        health = httpx.get(url + "/health").json()["replicas"]
        assert health[1 - started["replica"]] == {"engine": str(1 - started["replica"]), "state": "ready"}
        assert complete(url, prompt)["choices"][0]["finish_reason"] == "length"  # the other one answers
        deadline = time.monotonic() + 30
        while httpx.get(url + "/health").json()["replicas"][started["replica"]]["state"] != "ready":
            assert time.monotonic() < deadline, "the killed replica did not come back"
            time.sleep(0.1)


def test_a_request_its_dying_replica_had_not_started_goes_to_the_other(tmp_path):
    # Replica 0 holds any first request 30 s before stepping; round-robin sends the first to it.
    app, replicas = serve(tmp_path, "round-robin", holds=(30.0, 0.0))
    with server_in_thread(app) as url:
        answers = []
        thread = threading.Thread(target=lambda: answers.append(complete(url, list(range(4000, 4040)), 5)))
        thread.start()
        deadline = time.monotonic() + 10
        while replicas.counts()[0] == 0:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        os.kill(_pids(app)[0], signal.SIGKILL)
        thread.join(30)
    assert answers and answers[0]["choices"][0]["finish_reason"] == "length"
    assert len(answers[0]["choices"][0]["text"]) > 0 and replicas.counts()[1] == 1
