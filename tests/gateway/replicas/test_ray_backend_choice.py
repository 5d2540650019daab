"""Choosing the Ray backend: vLLM's flag and argument names and values ("uni" runs as "mp"), the
bundle a replica reserves (GPUs on CUDA, one CPU otherwise), and without Ray installed a refusal
that says how to install it (exit status 2 for the command line, ValueError for `LLM`) before any
model loads."""

from __future__ import annotations

import sys

import pytest

from spillway import LLM
from spillway.gateway.cli.main import build_parser, main, refusals
from spillway.gateway.replicas.ray_cluster import RayMissing, import_ray, replica_bundle
from spillway.protocol.config import WorkerConfig


@pytest.mark.parametrize("backend", ["mp", "uni", "ray"])
def test_vllms_backend_names_are_taken(backend):
    args = build_parser().parse_args(["serve", "-dp", "2", "--distributed-executor-backend", backend])
    assert args.distributed_executor_backend == backend and refusals(args) == []


def test_the_default_backend_is_local_processes():
    assert build_parser().parse_args(["serve"]).distributed_executor_backend == "mp"


def test_a_worker_is_not_given_the_ray_backend(capsys):
    assert main(["worker", "--connect", "tcp://127.0.0.1:5999", "--distributed-executor-backend", "ray"]) == 2
    assert "--distributed-executor-backend ray: a worker does not place workers" in capsys.readouterr().err


@pytest.mark.parametrize("device, tensor_parallel_size, cluster, bundle, env", [
    ("auto", 1, {"CPU": 4.0}, {"CPU": 1.0}, {"OMP_NUM_THREADS": "1"}),  # no GPUs in the cluster
    ("cpu", 2, {"CPU": 4.0, "GPU": 8.0}, {"CPU": 2.0}, {"OMP_NUM_THREADS": "1"}),  # a core a rank
    ("auto", 2, {"CPU": 64.0, "GPU": 8.0}, {"GPU": 2.0}, {}),
    ("cuda", 1, {"CPU": 64.0, "GPU": 8.0}, {"GPU": 1.0}, {}),
])
def test_a_replica_reserves_its_gpus_or_one_cpu(device, tensor_parallel_size, cluster, bundle, env):
    config = WorkerConfig(device=device, tensor_parallel_size=tensor_parallel_size)
    placed = replica_bundle(config, cluster)
    assert (placed.resources, placed.env) == (bundle, env)


def test_cuda_on_a_cluster_without_gpus_is_refused_by_the_setting_as_given():
    with pytest.raises(RuntimeError, match="the Ray cluster has no GPUs for --device cuda"):
        replica_bundle(WorkerConfig(device="cuda", settings_spelling="flags"), {"CPU": 8.0})


def test_a_numbered_gpu_is_refused_since_ray_assigns_them():
    with pytest.raises(RuntimeError, match=r"device='cuda:1': Ray gives each replica its GPUs"):
        replica_bundle(WorkerConfig(device="cuda:1"), {"CPU": 8.0, "GPU": 2.0})


@pytest.fixture
def no_ray(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError


def test_without_ray_the_import_says_how_to_install_it(no_ray):
    with pytest.raises(RayMissing, match="pip install ray"):
        import_ray()


def test_without_ray_serve_exits_2_naming_the_install(no_ray, capsys):
    assert main(["serve", "-dp", "2", "--distributed-executor-backend", "ray"]) == 2
    assert "--distributed-executor-backend ray needs Ray, which is not installed: pip install ray" \
        in capsys.readouterr().err


def test_without_ray_llm_refuses_before_a_worker_starts(no_ray):
    with pytest.raises(ValueError, match=r"distributed_executor_backend='ray'\) needs Ray.*pip install ray"):
        LLM(data_parallel_size=2, distributed_executor_backend="ray")


def test_llm_refuses_a_backend_vllm_does_not_name():
    with pytest.raises(ValueError, match="distributed_executor_backend='threads'.*not one of mp, uni, ray"):
        LLM(distributed_executor_backend="threads")
