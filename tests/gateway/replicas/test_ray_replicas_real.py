"""Replicas of the real SmolLM2 placed on a Ray cluster (`--distributed-executor-backend ray`), on
the CPU, on the local cluster the gateway starts itself (one CPU a replica): `spillway serve -dp 2`
answers what local replicas answer, /health and /metrics show both engines, and a worker killed
on its node is lost at once and comes back through its actor; `LLM(data_parallel_size=2,
distributed_executor_backend="ray")` generates what one engine does and leaves no placement
group behind."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import httpx
import pytest

from server_helpers import MODEL, engine_values, real_server
from spillway import LLM, SamplingParams

PROMPTS = [f"Tell me about the number {k} in one sentence." for k in range(4)]
RAY_FLAGS = ("--data-parallel-size", "2", "--distributed-executor-backend", "ray", "--max-model-len", "256")


def greedy_texts(url: str) -> list[str]:
    texts = []
    for prompt in PROMPTS:
        reply = httpx.post(url + "/v1/completions", timeout=120, json={
            "model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0.0, "ignore_eos": True})
        assert reply.status_code == 200, reply.text
        texts.append(reply.json()["choices"][0]["text"])
    return texts


def replica_states(url: str) -> list[str]:
    return [replica["state"] for replica in httpx.get(url + "/health", timeout=10).json()["replicas"]]


def worker_pids(log: str) -> dict[int, list[int]]:
    """Each replica's worker pids in the order they attached, from the gateway's log."""
    pids: dict[int, list[int]] = {}
    for replica, pid in re.findall(r"replica (\d+): worker pid (\d+)", log):
        pids.setdefault(int(replica), []).append(int(pid))
    return pids


def wait_for(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


@pytest.mark.slow
def test_ray_replicas_answer_as_local_ones_and_a_killed_worker_rejoins():
    with real_server("--data-parallel-size", "2", "--max-model-len", "256") as local:
        expected = greedy_texts(local.url)
    with real_server(*RAY_FLAGS) as server:
        assert replica_states(server.url) == ["ready", "ready"]
        assert greedy_texts(server.url) == expected
        assert set(engine_values(server.url, "vllm:num_requests_running")) == {("0",), ("1",)}
        first = worker_pids(server.log())
        assert sorted(first) == [0, 1] and first[0] != first[1]
        os.kill(first[0][0], signal.SIGKILL)
        wait_for(lambda: replica_states(server.url)[0] != "ready", 10, "the killed worker was not noticed")
        assert replica_states(server.url)[1] == "ready"
        wait_for(lambda: replica_states(server.url) == ["ready", "ready"], 180, "the replica did not rejoin")
        again = worker_pids(server.log())[0]
        assert len(again) == 2 and again[1] != first[0][0]
        assert "the worker process was killed by SIGKILL" in server.log()
        assert greedy_texts(server.url) == expected
    assert all(_gone(pid) for pid in (again[1], first[1][0])), "a worker outlived its gateway"


@pytest.mark.slow
def test_llm_on_ray_replicas_generates_what_one_engine_does_and_removes_its_placement_groups():
    import ray

    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    texts = {}
    try:
        for backend, size in (("mp", 1), ("ray", 2)):
            llm = LLM(data_parallel_size=size, distributed_executor_backend=backend, routing="round-robin",
                      max_model_len=256)
            try:
                texts[backend] = [out.outputs[0].token_ids for out in llm.generate(PROMPTS, params, use_tqdm=False)]
            finally:
                llm.shutdown()
        groups = ray.util.placement_group_table()
        assert len(groups) == 2 and {group["state"] for group in groups.values()} == {"REMOVED"}
    finally:
        ray.shutdown()
    assert texts["ray"] == texts["mp"] and all(len(ids) == 12 for ids in texts["mp"])
