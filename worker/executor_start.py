"""An executor's start-up, the same on every tensor-parallel rank (worker/engine.py runs it on
rank 0, worker/tp_rank.py on the others): the forward passes it runs (profiling, graph capture,
warm-up) call collectives, so every rank must take the same road in the same order.

    build_executor ──► [rank 0: a draft model's share] ──► pool_blocks (MIN over the ranks)
                   ──► allocate_kv_cache ──► [rank 0: the CPU tier] ──► finish_start
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from spillway.protocol.config import WorkerConfig
from spillway.worker.executor import Executor, load_model
from spillway.worker.models import loader


@dataclass(frozen=True, slots=True)
class Limits:
    """What the model and the configuration allow a step and a sequence, on every rank."""

    max_model_len: int
    max_num_batched_tokens: int


def build_executor(config: WorkerConfig, files: loader.ModelFiles, hf_config, *, device: torch.device,
                   dtype: torch.dtype, kv_cache_dtype: torch.dtype,
                   shard: tuple[int, int] | None = None) -> tuple[Executor, Limits]:
    """Load the model (this rank's shard of it with `shard`) and build its executor, no pool yet."""
    model = load_model(hf_config, files, device=device, dtype=dtype, seed=config.seed,
                       input_major_weights=config.input_major_weights, shard=shard)
    limits = Limits(_max_model_len(config, hf_config, getattr(model, "sliding_window", None)),
                    config.max_num_batched_tokens or max(8192, config.max_num_seqs))
    executor = Executor(model, block_size=config.block_size, device=device, dtype=dtype,
                        kv_cache_dtype=kv_cache_dtype, max_num_seqs=config.max_num_seqs,
                        max_num_batched_tokens=limits.max_num_batched_tokens,
                        max_model_len=limits.max_model_len, speculative=config.speculative is not None)
    return executor, limits


def _max_model_len(config: WorkerConfig, hf_config, window: int | None) -> int:
    max_model_len = config.max_model_len or int(getattr(hf_config, "max_position_embeddings", 2048))
    if window is not None and max_model_len > window:
        # Sliding-window attention is not implemented: stay within one window, exactly.
        if config.max_model_len is not None:
            raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's sliding "
                             f"window ({window}), which Spillway does not implement yet")
        max_model_len = window
    return max_model_len


def pool_blocks(executor: Executor, config: WorkerConfig, limits: Limits, *, tensor_parallel: bool) -> int:
    """The KV pool's block count: the override (the same on every rank), else what fits this
    device, at most what `max_num_seqs` full-length requests use; with `tensor_parallel`, the
    smallest over the ranks (all_reduce MIN), so that a block id names the same slot in every
    rank's pool. ValueError when the pool holds less than one `max_model_len` sequence."""
    if config.num_gpu_blocks_override is not None:
        if config.num_gpu_blocks_override < 1:
            raise ValueError("num_gpu_blocks_override must be at least 1")
        return config.num_gpu_blocks_override
    with_graphs = executor.device.type == "cuda" and not config.enforce_eager
    num_blocks = executor.kv_pool_blocks(gpu_memory_utilization=config.gpu_memory_utilization,
                                         with_graphs=with_graphs)
    blocks_per_request = math.ceil(limits.max_model_len / config.block_size)
    num_blocks = min(num_blocks, config.max_num_seqs * blocks_per_request)
    if tensor_parallel:
        num_blocks = min_over_ranks(num_blocks, executor.device)
    if num_blocks < blocks_per_request:
        raise ValueError(
            f"the KV cache holds {num_blocks * config.block_size} tokens, fewer than "
            f"max_model_len={limits.max_model_len}; lower max_model_len or give it more memory"
        )
    return num_blocks


def min_over_ranks(value: int, device: torch.device) -> int:
    """The smallest of every rank's `value` (on the device: NCCL reduces device tensors)."""
    tensor = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
    return int(tensor.item())


def finish_start(executor: Executor, config: WorkerConfig) -> None:
    """After the pool: the CUDA graphs (the same buckets on every rank), then the eager warm-up."""
    if executor.device.type == "cuda" and not config.enforce_eager:
        executor.capture_graphs()
    executor.warm_up()
