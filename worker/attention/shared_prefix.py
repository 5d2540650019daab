"""The prefix that every sequence of a step shares: found on the host copy of the block tables.

Cascade attention (kernels/cascade_attention.py) reads such a prefix's keys and values once
for all of a step's rows. The runner stages its length with the step's other inputs
(worker/attention/step_inputs.py): the eager step and the prefill graphs' cascade variants read it from
device memory, and the host value picks the graph (worker/runner/cuda_graphs.py).
"""

from __future__ import annotations

import numpy as np

# A shared prefix shorter than this runs the plain kernels. Below 1,024 tokens one sequence's
# reread of it is at most 4 MiB a layer with Qwen3-8B's KV heads (8 x 128 in bf16, 4 KiB a
# token), under a microsecond of an H200's bandwidth, about what the cascade path adds (a
# second launch, each row's split partials written and read back); a GPU measurement tunes it.
CASCADE_MIN_TOKENS = 1024


def shared_prefix_len(starts: list[int], host_block_tables, block_size: int,
                      min_tokens: int = CASCADE_MIN_TOKENS) -> int:
    """Tokens at the head of every sequence that sit in the same blocks and were cached before
    this step: whole blocks, up to the first table column where a row differs from row 0 and
    at most the smallest start. 0 for one sequence or under `min_tokens`. `host_block_tables`
    [B, width] (a numpy array or CPU tensor) is compared column-wise: no device read."""
    if len(starts) < 2:
        return 0
    limit = min(starts) // block_size
    if limit * block_size < min_tokens:
        return 0
    leading = np.asarray(host_block_tables[: len(starts), :limit])
    if (leading[1:, 0] != leading[0, 0]).any():  # the usual batch of unrelated sequences: O(B)
        return 0
    differs = (leading[1:] != leading[0]).any(axis=0)
    shared = int(differs.argmax()) if differs.any() else limit
    return shared * block_size if shared * block_size >= min_tokens else 0


def may_share_a_prefix(max_num_seqs: int, max_context_len: int) -> bool:
    """Whether a runner's steps can ever share a prefix long enough for cascade attention: two
    sequences, each with a new token after CASCADE_MIN_TOKENS cached ones."""
    return max_num_seqs >= 2 and max_context_len > CASCADE_MIN_TOKENS
