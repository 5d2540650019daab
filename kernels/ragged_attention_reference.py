"""The ragged attention kernels in plain torch, float32 math, one sequence at a time: what
kernels/paged_attention_prefill.py and kernels/cascade_attention.py are tested against. A
float8 cache's keys and values are upcast, exactly, like any other; padded rows are 0."""

from __future__ import annotations

import torch

from spillway.kernels.fp8 import cache_values


def _keys_and_values(kv_cache: torch.Tensor, layer: int, table: torch.Tensor, end: int,
                     group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions [0, end) of one block table's keys and values, float32, each KV head repeated
    for its `group` query heads: `[end, heads, head_dim]` each."""
    block_size, num_kv_heads, head_dim = kv_cache.shape[3], kv_cache.shape[4], kv_cache.shape[5]
    blocks = table[: -(-end // block_size)].long()
    keys = kv_cache[blocks, layer, 0].reshape(-1, num_kv_heads, head_dim)[:end]
    values = cache_values(kv_cache, layer)[blocks].reshape(-1, num_kv_heads, head_dim)[:end]
    return keys.float().repeat_interleave(group, dim=1), values.float().repeat_interleave(group, dim=1)


def paged_prefill_attention_reference(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """`paged_prefill_attention`: each sequence's rows, causal over its context."""
    group = q.shape[1] // kv_cache.shape[4]
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    starts = query_start_loc.tolist()
    for seq, seq_len in enumerate(seq_lens.tolist()):
        rows = slice(starts[seq], starts[seq + 1])
        query_len = starts[seq + 1] - starts[seq]
        if query_len == 0:
            continue
        keys, values = _keys_and_values(kv_cache, layer, block_tables[seq], seq_len, group)
        scores = torch.einsum("qhd,khd->hqk", q[rows].float(), keys) * scale
        query_pos = torch.arange(seq_len - query_len, seq_len, device=q.device)
        visible = torch.arange(seq_len, device=q.device)[None, :] <= query_pos[:, None]
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        out[rows] = torch.einsum("hqk,khd->qhd", probs, values)
    return out.to(q.dtype)


def cascade_attention_reference(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    prefix_len: int,
) -> torch.Tensor:
    """`cascade_attention` in plain torch (float32): each row's scores over the shared prefix
    (row 0's blocks, unmasked) and over its own keys after it (causal), softmax-ed apart and
    merged through their log-sum-exps. Padded rows are 0."""
    group = q.shape[1] // kv_cache.shape[4]

    def keys_and_values(seq: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        return _keys_and_values(kv_cache, layer, block_tables[seq], end, group)

    def partial(rows: torch.Tensor, keys, values, visible) -> tuple[torch.Tensor, torch.Tensor]:
        scores = torch.einsum("qhd,khd->hqk", rows.float(), keys) * scale
        scores = scores.masked_fill(~visible, float("-inf"))
        return torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), values), torch.logsumexp(scores, -1).T

    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    starts = query_start_loc.tolist()
    prefix_keys, prefix_values = keys_and_values(0, prefix_len)
    for seq, seq_len in enumerate(seq_lens.tolist()):
        rows = q[starts[seq] : starts[seq + 1]]
        keys, values = keys_and_values(seq, seq_len)
        query_pos = torch.arange(seq_len - rows.shape[0], seq_len, device=q.device)
        own = torch.arange(prefix_len, seq_len, device=q.device)
        suffix, suffix_lse = partial(rows, keys[prefix_len:], values[prefix_len:],
                                     own[None, :] <= query_pos[:, None])
        prefix, prefix_lse = partial(rows, prefix_keys, prefix_values,
                                     torch.ones(rows.shape[0], prefix_len, dtype=torch.bool, device=q.device))
        total_lse = torch.logaddexp(prefix_lse, suffix_lse)
        out[starts[seq] : starts[seq + 1]] = (prefix * (prefix_lse - total_lse).exp()[..., None]
                                              + suffix * (suffix_lse - total_lse).exp()[..., None])
    return out.to(q.dtype)
