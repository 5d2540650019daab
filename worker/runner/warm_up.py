"""Start-up steps that compile the eager path's kernels before the first request (CUDA only).

Triton compiles a kernel per specialisation: its constexprs, and its integer arguments'
divisibility by 16. A variant first met by a request compiles inside that request's step
(~1 s): the profiling step (8,192 tokens) compiled one side only, and cascade attention runs
only when a step's sequences share a long prefix, its suffix pass in two tile sizes (by the
step's longest query). These steps meet the rest first (the CUDA graphs, cascade twins
included, compile theirs in the run before each capture).
"""

from __future__ import annotations

import math

from spillway.worker.runner.model_runner import ChunkInput, ModelRunner


def warm_up_eager_kernels(runner: ModelRunner, num_tokens: int = 513) -> None:
    """One eager step of `num_tokens` (odd, past every prefill graph) over the pool's first
    blocks, which no request holds yet (their slots get finite values that every later
    context overwrites before reading), then a cascade step (`warm_up_cascade`)."""
    assert runner.kv_cache is not None, "allocate the KV cache first"
    num_tokens = min(num_tokens, runner.inputs.capacity[0])
    num_blocks = math.ceil(num_tokens / runner.block_size)
    if num_blocks > min(runner.kv_cache.shape[0], runner.max_blocks_per_seq):
        return
    runner._forward(runner.inputs.stage([ChunkInput([0] * num_tokens, 0, list(range(num_blocks)))]))
    warm_up_cascade(runner)


def warm_up_cascade(runner: ModelRunner) -> None:
    """Cascade attention's kernels (worker/attention/triton_paged.py): two sequences on
    CASCADE_MIN_TOKENS shared tokens of the pool's first blocks (zeros, or what the step above
    wrote: finite), each writing its new tokens into blocks of its own after them: one token
    each (the suffix pass's short tiles), then the second `short_query_tokens + 1` (its long
    ones). Skipped where the pool, a block table or a step (one sequence at most: then no step
    ever shares a prefix) cannot hold that."""
    from spillway.worker.attention.shared_prefix import CASCADE_MIN_TOKENS

    prefix_blocks = -(-CASCADE_MIN_TOKENS // runner.block_size)
    prefix = list(range(prefix_blocks))
    start = prefix_blocks * runner.block_size
    for query_len in (1, runner.short_query_tokens + 1):
        own_blocks = -(-query_len // runner.block_size)
        if (prefix_blocks + 1 + own_blocks > runner.kv_cache.shape[0] or runner.max_num_seqs < 2
                or prefix_blocks + own_blocks > runner.max_blocks_per_seq):
            return
        own = list(range(prefix_blocks + 1, prefix_blocks + 1 + own_blocks))
        runner._forward(runner.inputs.stage([ChunkInput([0], start, [*prefix, prefix_blocks]),
                                             ChunkInput([0] * query_len, start, [*prefix, *own])]))
