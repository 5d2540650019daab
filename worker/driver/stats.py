"""The worker's counters for the gateway (`Stats`), cheap enough for every report, and what it
tells a gateway at the start (`Ready`).

`check_invariants` walks every block (58 ms at 55k blocks, 127 ms at 131k): it runs only
when asked (ControlCommand.CHECK_INVARIANTS) or in debug mode, never on a routine report.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from spillway.protocol.config import WorkerConfig
from spillway.protocol.messages import PROTOCOL_VERSION, Ready, RequestDelta, Stats
from spillway.worker.core.block_manager import BlockManager
from spillway.worker.core.scheduler import Scheduler
from spillway.worker.core.step_plan import StepPlan
from spillway.worker.driver.kv_pulls import KvTransferCounters
from spillway.worker.kv_tier.copier import KVCopier
from spillway.worker.speculative.decoder import SpecMetrics

logger = logging.getLogger(__name__)


def ready_message(config: WorkerConfig, block_manager: BlockManager, *, model: str, max_model_len: int,
                  max_num_batched_tokens: int, vocab_size: int, eos_token_ids: Iterable[int], device: str,
                  dtype: str, kv_address: str = "") -> Ready:
    """What the worker tells a gateway at the start: the settings it runs with, as resolved;
    `kv_address`: where its KV server listens, when it produces (protocol/kv_transfer.py)."""
    return Ready(
        protocol_version=PROTOCOL_VERSION,
        model=model,
        block_size=block_manager.block_size,
        hash_seed=config.hash_seed,
        num_gpu_blocks=block_manager.num_gpu_blocks,
        num_cpu_blocks=block_manager.num_cpu_blocks,
        max_model_len=max_model_len,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        vocab_size=vocab_size,
        eos_token_ids=list(eos_token_ids),
        device=device,
        dtype=dtype.removeprefix("torch."),
        enable_prefix_caching=config.enable_prefix_caching,
        kv_address=kv_address,
        kv_role="" if config.kv_transfer is None else config.kv_transfer.kv_role,
    )


def collect_stats(block_manager: BlockManager, scheduler: Scheduler, *, num_steps: int,
                  check_invariants: bool, copier: KVCopier | None = None, spec: SpecMetrics | None = None,
                  kv_transfer: KvTransferCounters | None = None) -> Stats:
    """O(1) counters; `invariants_ok` is None unless `check_invariants`. `copier`: the CPU
    tier's, if any; `spec`: speculative decoding's counters, where it runs; `kv_transfer`: the
    blocks pulled from and served to other workers."""
    ok = None
    if check_invariants:
        try:
            block_manager.check_invariants()
            ok = True
        except AssertionError:
            logger.exception("block manager invariants broken")
            ok = False
    seconds = copier.seconds() if copier else (0.0, 0.0)
    counts = scheduler.counts
    spec = spec or SpecMetrics()  # no speculation: every count 0
    kv_transfer = kv_transfer or KvTransferCounters()
    return Stats(
        num_running=scheduler.num_running,
        num_waiting=scheduler.num_waiting,
        gpu_cache_usage=block_manager.usage,
        cpu_cache_usage=block_manager.cpu_usage,
        num_gpu_blocks=block_manager.num_gpu_blocks,
        num_free_gpu_blocks=block_manager.num_free_blocks,
        num_cpu_blocks=block_manager.num_cpu_blocks,
        prefix_cache_queries=counts.prefix_cache_queries,
        prefix_cache_hits=counts.prefix_cache_hits,
        cached_tokens_gpu=counts.cached_tokens_gpu,
        cached_tokens_cpu=counts.cached_tokens_cpu,
        cpu_prefix_cache_queries=counts.cpu_cache_queries,
        cpu_prefix_cache_hits=counts.cpu_cache_hits,
        kv_offload_bytes_gpu_to_cpu=copier.bytes_to_cpu if copier else 0,
        kv_offload_bytes_cpu_to_gpu=copier.bytes_to_gpu if copier else 0,
        kv_offload_seconds_gpu_to_cpu=seconds[0],
        kv_offload_seconds_cpu_to_gpu=seconds[1],
        num_preemptions=counts.num_preemptions,
        num_steps=num_steps,
        invariants_ok=ok,
        spec_num_drafts=spec.num_drafts,
        spec_num_draft_tokens=spec.num_draft_tokens,
        spec_num_accepted_tokens=spec.num_accepted_tokens,
        spec_num_accepted_tokens_per_pos=list(spec.accepted_per_position),
        kv_transfer_bytes_received=kv_transfer.bytes_received,
        kv_transfer_bytes_sent=kv_transfer.bytes_sent,
        kv_transfer_seconds_received=kv_transfer.seconds_received,
        kv_transfer_seconds_sent=kv_transfer.seconds_sent,
        kv_transfer_failures=kv_transfer.failures,
    )


def step_tokens(plan: StepPlan | None, deltas: list[RequestDelta]) -> int:
    """The tokens of one engine step as vLLM's vllm:iteration_tokens_total counts them: prompt
    tokens the step computes plus tokens it generated. With a step run ahead, `deltas` are the
    previous step's tokens, committed in this one: each token is counted once either way."""
    prompt = 0
    for chunk in plan.chunks if plan is not None else ():
        prompt += max(0, min(chunk.start + chunk.num_tokens, chunk.request.num_prompt_tokens) - chunk.start)
    return prompt + sum(len(delta.new_token_ids) for delta in deltas)
