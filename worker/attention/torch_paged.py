"""Paged attention: the backend interface and the plain-torch backend.

The KV cache is one tensor `[num_blocks, num_layers, kv_sides, block_size, num_kv_heads, head_dim]`:
two sides (keys, then values) for most models; one for an MLA model (worker/models/mla.py),
whose one latent row a token serves as its key and, its first values, as its value.
The token at position p of a sequence with block table T lives at block T[p // block_size],
offset p % block_size; its slot is `T[p // block_size] * block_size + p % block_size`.

A step packs the new tokens of every sequence into rows of q/k/v:

    rows   | seq 0: 5 new tokens | seq 1: 1 | seq 2: 1 | pad |
    start  | 0                   | 37       | 12       |     |

`start` tokens of each sequence are already in the cache. Each layer calls
`backend.forward`, which first stores the new k/v in their slots, then lets every new query
attend causally to its sequence's `[cached prefix + new tokens]`; or, on CUDA, where one kernel
before attention has stored them already, `backend.attend`, which only attends.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from spillway.worker.attention.step_inputs import StepLayout


@dataclass(slots=True)
class AttentionMetadata:
    """One step's batch layout, built once by the runner and read by every layer.

    Sequence i owns rows `query_start_loc[i] : query_start_loc[i + 1]`. Rows past
    `query_start_loc[-1]` are padding; their slot is -1 and their output is unspecified.
    """

    query_lens: list[int]
    starts: list[int]
    query_start_loc: list[int]
    block_tables: torch.Tensor  # int64 [num_seqs, max_blocks], padded with block 0
    slot_mapping: torch.Tensor  # int64 [num_rows], -1 for a padded row

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)


class AttentionBackend(ABC):
    """What a model layer needs from attention; the CUDA backend implements the same calls."""

    def __init__(self, block_size: int, scale: float | None = None) -> None:
        self.block_size = block_size
        self.scale = scale  # None: head_dim ** -0.5

    @abstractmethod
    def build_metadata(
        self,
        query_lens: list[int],
        starts: list[int],
        block_tables: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> AttentionMetadata: ...

    def metadata_for(self, layout: StepLayout) -> AttentionMetadata:
        """`build_metadata` for an eager step staged by worker/attention/step_inputs.py; a backend that
        can read the staged device views takes them from `layout` instead of copying again."""
        return self.build_metadata(layout.query_lens, layout.starts, layout.block_tables, layout.slot_mapping)

    @abstractmethod
    def forward(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor | None,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Store k/v `[rows, kv_heads, head_dim]`, return attention of q `[rows, heads, head_dim]`.
        With a one-sided cache `v` is None: k's rows are stored once and read as values too."""

    def attend(
        self, layer_idx: int, q: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """`forward` for a layer whose k/v an earlier kernel already stored (kernels/qkv_prepare.py).

        Only a backend that reads every key and value from the cache can offer it.
        """
        raise NotImplementedError(f"{type(self).__name__} reads the new k/v directly; call forward")


@dataclass(slots=True)
class _ExtendPlan:
    """A sequence with more than one new token: attended on its own."""

    row_start: int
    row_end: int
    context_len: int
    block_ids: torch.Tensor | None  # blocks covering the context; None: no cached prefix
    mask: torch.Tensor | None  # bool [new tokens, context_len]; None: plain causal


@dataclass(slots=True)
class _DecodePlan:
    """The sequences with one new token, attended together."""

    rows: torch.Tensor | None  # their q rows; None: rows 0..count-1
    count: int
    block_ids: torch.Tensor  # flat [count * blocks], each sequence's table cut to the longest
    mask: torch.Tensor  # bool [count, 1, 1, blocks * block_size]: key position < context length


@dataclass(slots=True)
class TorchAttentionMetadata(AttentionMetadata):
    write_rows: torch.Tensor | None  # rows that have a slot; None: every row
    write_blocks: torch.Tensor  # per written row: block id
    write_offsets: torch.Tensor  # per written row: offset within the block
    decodes: _DecodePlan | None
    extends: list[_ExtendPlan]


class TorchAttentionBackend(AttentionBackend):
    """Paged attention in plain torch: the CPU backend and the reference for the kernels.

    Sequences with one new token (decodes) are batched: their KV is gathered block by block
    into a padded `[decodes, max_len]` tensor and attended with one masked SDPA per layer,
    grouping query heads by KV head so KV is never repeated. Sequences with several new
    tokens (prefill, extend) get one SDPA each: over the new k/v alone when nothing is cached,
    else over their gathered blocks with an offset causal mask.
    """

    def build_metadata(
        self,
        query_lens: list[int],
        starts: list[int],
        block_tables: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> TorchAttentionMetadata:
        assert all(n > 0 for n in query_lens), "every sequence needs at least one new token"
        device = slot_mapping.device
        query_start_loc = [0, *itertools.accumulate(query_lens)]
        write_rows = None
        slots = slot_mapping
        if slot_mapping.numel() > query_start_loc[-1] or bool((slot_mapping < 0).any()):
            write_rows = torch.nonzero(slot_mapping >= 0).flatten()
            slots = slot_mapping[write_rows]
        decodes = [i for i, n in enumerate(query_lens) if n == 1]
        return TorchAttentionMetadata(
            query_lens,
            starts,
            query_start_loc,
            block_tables,
            slot_mapping,
            write_rows=write_rows,
            write_blocks=torch.div(slots, self.block_size, rounding_mode="floor"),
            write_offsets=slots % self.block_size,
            decodes=self._plan_decodes(decodes, starts, query_start_loc, block_tables) if decodes else None,
            extends=[
                self._plan_extend(start, n, row_start, block_tables[seq], device)
                for seq, (start, n, row_start) in enumerate(zip(starts, query_lens, query_start_loc))
                if n > 1
            ],
        )

    def _plan_decodes(
        self, decodes: list[int], starts: list[int], query_start_loc: list[int], block_tables: torch.Tensor
    ) -> _DecodePlan:
        device = block_tables.device
        rows = None
        if decodes != list(range(len(decodes))):
            rows = torch.tensor([query_start_loc[i] for i in decodes], device=device)
        context_lens = torch.tensor([starts[i] + 1 for i in decodes], device=device)
        num_blocks = -(-int(context_lens.max()) // self.block_size)
        tables = block_tables[torch.tensor(decodes, device=device), :num_blocks]
        key_pos = torch.arange(num_blocks * self.block_size, device=device)
        mask = (key_pos[None, :] < context_lens[:, None])[:, None, None, :]
        return _DecodePlan(rows, len(decodes), tables.reshape(-1), mask)

    def _plan_extend(
        self, start: int, num_new: int, row_start: int, block_table: torch.Tensor, device: torch.device
    ) -> _ExtendPlan:
        plan = _ExtendPlan(row_start, row_start + num_new, start + num_new, None, None)
        if start > 0:
            plan.block_ids = block_table[: -(-plan.context_len // self.block_size)]
            query_pos = torch.arange(start, start + num_new, device=device)
            key_pos = torch.arange(plan.context_len, device=device)
            plan.mask = key_pos[None, :] <= query_pos[:, None]
        return plan

    def forward(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        assert isinstance(metadata, TorchAttentionMetadata)
        # Per-layer views [num_blocks, block_size, kv_heads, head_dim]; a block's row is contiguous.
        if kv_cache.shape[2] == 1:
            assert v is None, "a one-sided (latent) cache stores keys only"
            k_cache = v_cache = kv_cache[:, layer_idx, 0]
            v = k
        else:
            k_cache, v_cache = kv_cache[:, layer_idx, 0], kv_cache[:, layer_idx, 1]
        self._store(k_cache, v_cache, k, v, metadata)
        decodes = metadata.decodes
        if decodes is not None and decodes.rows is None and decodes.count == q.shape[0]:
            return self._decode(q, k_cache, v_cache, decodes)
        out = torch.zeros_like(q)
        if decodes is not None:
            rows = slice(0, decodes.count) if decodes.rows is None else decodes.rows
            out[rows] = self._decode(q[rows], k_cache, v_cache, decodes)
        for plan in metadata.extends:
            rows = slice(plan.row_start, plan.row_end)
            out[rows] = self._extend(q[rows], k[rows], v[rows], k_cache, v_cache, plan)
        return out

    @staticmethod
    def _store(k_cache, v_cache, k, v, metadata: TorchAttentionMetadata) -> None:
        if metadata.write_rows is not None:
            k, v = k[metadata.write_rows], v[metadata.write_rows]
        index = (metadata.write_blocks, metadata.write_offsets)
        k_cache.index_put_(index, k)
        if v_cache is not k_cache:
            v_cache.index_put_(index, v)

    def _gather(self, cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        """The given blocks' tokens, `[len(block_ids) * block_size, kv_heads, head_dim]`."""
        num_blocks, block_size, num_kv_heads, head_dim = cache.shape
        flat = cache.reshape(num_blocks, block_size * num_kv_heads * head_dim)
        return flat.index_select(0, block_ids).view(-1, num_kv_heads, head_dim)

    def _decode(self, q, k_cache, v_cache, plan: _DecodePlan) -> torch.Tensor:
        num_seqs, num_heads, head_dim = q.shape
        num_kv_heads = k_cache.shape[2]
        keys = self._gather(k_cache, plan.block_ids).view(num_seqs, -1, num_kv_heads, head_dim)
        values = keys if v_cache is k_cache else self._gather(v_cache, plan.block_ids).view(keys.shape)
        # The query heads sharing a KV head take the place of the query-length dim.
        grouped_q = q.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
        out = F.scaled_dot_product_attention(
            grouped_q,
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=plan.mask,
            scale=self.scale,
        )
        return out.view(num_seqs, num_heads, head_dim)

    def _extend(self, q, k, v, k_cache, v_cache, plan: _ExtendPlan) -> torch.Tensor:
        if plan.block_ids is not None:
            k = self._gather(k_cache, plan.block_ids)[: plan.context_len]
            v = k if v_cache is k_cache else self._gather(v_cache, plan.block_ids)[: plan.context_len]
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            attn_mask=plan.mask,
            is_causal=plan.mask is None,
            scale=self.scale,
            enable_gqa=True,
        )
        return out[0].transpose(0, 1)
