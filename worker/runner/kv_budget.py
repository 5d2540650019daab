"""The memory a device's KV pools may take, how a model and its draft model share it, and what
to change when it cannot hold one request.

The budget (`Executor.kv_budget`) is what the target's pool alone would take: on CUDA the
utilisation's share of the GPU less what is in use and a step's peak; on the CPU a fixed
1 GiB. With a draft model both pools come out of that budget in proportion to their bytes per
token, so that both hold the same number of tokens (vLLM sizes a draft's KV cache from the
target's budget the same way):

    budget ──► N = budget // (target block bytes + draft block bytes)   blocks in each pool
               (at most what max_num_seqs requests of max_model_len use)

Both pools have the same block size, so the same block count is the same number of tokens.
A draft holds k more tokens a request than the target (the drafts it feeds itself).
Where N blocks cannot hold one request, the message names the setting to change, as the
caller spells it, and the value that fits: max_model_len, and gpu_memory_utilization on CUDA
when a value up to 1 fits (the CPU's budget is fixed), or num_gpu_blocks_override when set.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

Spell = Callable[[str, object], str]  # a setting and its value as the caller writes them (WorkerConfig.spell)


@dataclass(frozen=True, slots=True)
class KVBudget:
    """Bytes the KV pools of a device may take. `gpu_total`: the GPU's memory, of which
    `gpu_memory_utilization` is a share; None on the CPU, whose budget no setting moves."""

    num_bytes: int
    gpu_memory_utilization: float = 0.9
    gpu_total: int | None = None

    def blocks(self, *block_bytes: int) -> int:
        """How many blocks fit in each of the pools whose blocks take `block_bytes` each."""
        return max(0, self.num_bytes // sum(block_bytes))

    def utilization_for(self, num_bytes: int) -> float | None:
        """The gpu_memory_utilization (rounded up to a hundredth) under which `num_bytes` more
        than the pools' share today fit; None on the CPU or where no value up to 1 does."""
        if self.gpu_total is None:
            return None
        needed = math.ceil((self.gpu_memory_utilization + (num_bytes - self.num_bytes) / self.gpu_total) * 100) / 100
        return needed if needed <= 1 else None


def blocks_per_request(max_model_len: int, block_size: int, extra_tokens: int = 0) -> int:
    """Blocks one request of max_model_len (and `extra_tokens` past it: a draft's) takes."""
    return math.ceil((max_model_len + extra_tokens) / block_size)


def shared_pool_blocks(budget: KVBudget, *, target_block_bytes: int, draft_block_bytes: int, block_size: int,
                       max_model_len: int, num_speculative_tokens: int, max_num_seqs: int, spell: Spell) -> int:
    """Blocks of the draft model's pool, as many as the target's pool will have from the same
    `budget`, at most what `max_num_seqs` requests use; ValueError, naming what to change,
    when they cannot hold one request of `max_model_len` and its drafts."""
    per_request = blocks_per_request(max_model_len, block_size, num_speculative_tokens)
    num_blocks = min(budget.blocks(target_block_bytes, draft_block_bytes), max_num_seqs * per_request)
    if num_blocks < per_request:
        raise ValueError(shortfall_message(
            num_blocks, budget, block_bytes=target_block_bytes + draft_block_bytes, block_size=block_size,
            max_model_len=max_model_len, extra_tokens=num_speculative_tokens, spell=spell,
            pools="the KV caches of the model and of its draft model hold"))
    return num_blocks


def shortfall_message(num_blocks: int, budget: KVBudget | None, *, block_bytes: int, block_size: int,
                      max_model_len: int, extra_tokens: int, spell: Spell, pools: str = "the KV cache holds") -> str:
    """Why `num_blocks` (of `block_bytes` in all the pools) cannot hold one request, and the
    values that fit. `budget`: None when the block count was given (num_gpu_blocks_override)."""
    needed_blocks = blocks_per_request(max_model_len, block_size, extra_tokens)
    drafts = f" (with its {extra_tokens} speculative tokens)" if extra_tokens else ""
    message = (f"{pools} {num_blocks * block_size} tokens ({num_blocks} blocks of {block_size}), and one request "
               f"of {spell('max_model_len', max_model_len)} needs {max_model_len + extra_tokens}{drafts}")
    fixes = []
    fitting_len = num_blocks * block_size - extra_tokens
    if fitting_len >= 2:  # the shortest max_model_len there is
        fixes.append(f"{spell('max_model_len', fitting_len)} or less")
    if budget is None:
        fixes.append(spell("num_gpu_blocks_override", needed_blocks))
    elif (utilization := budget.utilization_for(needed_blocks * block_bytes)) is not None:
        fixes.append(spell("gpu_memory_utilization", utilization))
    if not fixes:
        return message + "; no setting makes room for it on this device"
    return message + "; it fits with " + " or with ".join(fixes)
