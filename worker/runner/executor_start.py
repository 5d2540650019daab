"""An executor's start-up, the same on every tensor-parallel rank (worker/driver/engine.py runs it on
rank 0, worker/tp/rank.py on the others): the forward passes it runs (profiling, graph capture,
warm-up, the decode step's timing) call collectives, so every rank must take the same road in
the same order.

    build_executor ──► [rank 0: a draft model's share] ──► pool_blocks (MIN over the ranks)
                   ──► allocate_kv_cache ──► finish_start ──► [rank 0: the CPU tier]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from spillway.protocol.config import WorkerConfig
from spillway.protocol.model_len import long_max_model_len_problem, trained_length
from spillway.worker.runner.executor import Executor, load_model
from spillway.worker.runner.kv_budget import blocks_per_request, shared_pool_blocks, shortfall_message
from spillway.worker.runner.step_time import time_decode_step
from spillway.worker.models import loader


@dataclass(frozen=True, slots=True)
class Limits:
    """What the model and the configuration allow a step and a sequence, on every rank."""

    max_model_len: int
    max_num_batched_tokens: int


def build_executor(config: WorkerConfig, files: loader.ModelFiles, hf_config, *, device: torch.device,
                   dtype: torch.dtype, kv_cache_dtype: torch.dtype,
                   shard: tuple[int, int] | None = None) -> tuple[Executor, Limits]:
    """Load the model (this rank's shard of it with `shard`) and build its executor, no pool yet;
    ValueError before it loads for a max_model_len past the model's trained context (unless
    allowed: `WorkerConfig.allow_long_max_model_len`)."""
    trained = trained_length(hf_config.to_dict())
    problem = long_max_model_len_problem(config.max_model_len, trained, config.allow_long_max_model_len, config.spell)
    if problem is not None:
        raise ValueError(problem)
    model = load_model(hf_config, files, device=device, dtype=dtype, seed=config.seed,
                       input_major_weights=config.input_major_weights, shard=shard,
                       quantization=config.quantization)
    limits = Limits(_max_model_len(config, trained.tokens, getattr(model, "sliding_window", None)),
                    config.max_num_batched_tokens or max(8192, config.max_num_seqs))
    executor = Executor(model, block_size=config.block_size, device=device, dtype=dtype,
                        kv_cache_dtype=kv_cache_dtype, max_num_seqs=config.max_num_seqs,
                        max_num_batched_tokens=limits.max_num_batched_tokens,
                        max_model_len=limits.max_model_len, speculative=config.speculative is not None)
    return executor, limits


def _max_model_len(config: WorkerConfig, trained_tokens: int, window: int | None) -> int:
    max_model_len = config.max_model_len or trained_tokens
    if window is not None and max_model_len > window:
        # Sliding-window attention is not implemented: stay within one window, exactly.
        if config.max_model_len is not None:
            raise ValueError(f"{config.spell('max_model_len', config.max_model_len)} exceeds the model's sliding "
                             f"window ({window}), which Spillway does not implement yet")
        max_model_len = window
    return max_model_len


def draft_pool_blocks(executor: Executor, config: WorkerConfig, limits: Limits, draft_block_bytes: int) -> int:
    """Blocks of a draft model's pool (its blocks of `draft_block_bytes` each), after its
    weights are loaded and before the target's pool is sized: the same count as the target's
    pool will hold, out of the budget both share (worker/runner/kv_budget.py), or the override's.
    ValueError, naming what to change, when they cannot hold one request and its drafts."""
    assert config.speculative is not None
    k, block_size = config.speculative.num_speculative_tokens, config.block_size
    if config.num_gpu_blocks_override is not None:
        per_request = blocks_per_request(limits.max_model_len, block_size, k)
        num_blocks = min(config.num_gpu_blocks_override, config.max_num_seqs * per_request)
        if num_blocks < per_request:
            raise ValueError(shortfall_message(
                num_blocks, None, block_bytes=executor.runner.kv_block_bytes + draft_block_bytes,
                block_size=block_size, max_model_len=limits.max_model_len, extra_tokens=k, spell=config.spell,
                pools="the KV cache of the draft model holds"))
    else:
        budget = executor.kv_budget(gpu_memory_utilization=config.gpu_memory_utilization,
                                    with_graphs=_with_graphs(executor, config))
        num_blocks = shared_pool_blocks(budget, target_block_bytes=executor.runner.kv_block_bytes,
                                        draft_block_bytes=draft_block_bytes, block_size=block_size,
                                        max_model_len=limits.max_model_len, num_speculative_tokens=k,
                                        max_num_seqs=config.max_num_seqs, spell=config.spell)
    executor.draft_kv_bytes = num_blocks * draft_block_bytes
    return num_blocks


def pool_blocks(executor: Executor, config: WorkerConfig, limits: Limits, *, tensor_parallel: bool) -> int:
    """The KV pool's block count: the override (the same on every rank), else what fits this
    device, at most what `max_num_seqs` full-length requests use; with `tensor_parallel`, the
    smallest over the ranks (all_reduce MIN), so that a block id names the same slot in every
    rank's pool. ValueError, naming what to change, when the pool holds less than one
    `max_model_len` sequence."""
    if config.num_gpu_blocks_override is not None:
        if config.num_gpu_blocks_override < 1:
            raise ValueError(f"{config.setting('num_gpu_blocks_override')} must be at least 1")
        return config.num_gpu_blocks_override
    budget = executor.kv_budget(gpu_memory_utilization=config.gpu_memory_utilization,
                                with_graphs=_with_graphs(executor, config))
    block_bytes = executor.runner.kv_block_bytes
    per_request = blocks_per_request(limits.max_model_len, config.block_size)
    num_blocks = min(budget.blocks(block_bytes), config.max_num_seqs * per_request)
    if tensor_parallel:
        num_blocks = min_over_ranks(num_blocks, executor.device)
    if num_blocks < per_request:
        raise ValueError(shortfall_message(num_blocks, budget, block_bytes=block_bytes, block_size=config.block_size,
                                           max_model_len=limits.max_model_len, extra_tokens=0, spell=config.spell))
    return num_blocks


def _with_graphs(executor: Executor, config: WorkerConfig) -> bool:
    return executor.device.type == "cuda" and not config.enforce_eager


def min_over_ranks(value: int, device: torch.device) -> int:
    """The smallest of every rank's `value` (on the device: NCCL reduces device tensors)."""
    tensor = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
    return int(tensor.item())


def finish_start(executor: Executor, config: WorkerConfig) -> float:
    """After the pool: the CUDA graphs (the same buckets on every rank), then the eager warm-up;
    returns the seconds of the model's decode step, timed last (worker/runner/step_time.py)."""
    if executor.device.type == "cuda" and not config.enforce_eager:
        executor.capture_graphs()
    executor.warm_up()
    return time_decode_step(executor.runner)
