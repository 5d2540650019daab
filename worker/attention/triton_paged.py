"""Paged attention through the Triton kernels in `spillway.kernels`: the CUDA backend.

Same interface as `TorchAttentionBackend` (worker/attention/torch_paged.py): `build_metadata` once per
step, then `forward(layer_idx, q, k, v, kv_cache, metadata)` in every layer, which stores the
new k/v with `write_kv` and returns attention of q. `attend(layer_idx, q, kv_cache, metadata)`
is the same without the store, for a layer whose k/v an earlier kernel already wrote
(kernels/qkv_prepare.py). Which kernel runs:

    every sequence has the same query length Q <= max_decode_query_len
        -> paged_decode_attention   (decode Q = 1; speculative verification Q = k + 1)
    anything else (prefill, extend, mixed prefill + decode)
        -> paged_prefill_attention  (ragged; decodes are sequences with query_len 1)
    a step of >= 2 sequences whose first CASCADE_MIN_TOKENS or more cached tokens sit in the
    same blocks (worker/attention/shared_prefix.py), whatever their query lengths, eager or through a
    prefill graph's cascade variant
        -> cascade_attention        (the shared prefix's keys read once for all rows; its
                                     suffix pass at 16 rows a program where no query is
                                     longer than `short_query_tokens`, else 64)

The decode kernel is compiled per Q and per split count (its grid's third axis, chosen from
the batch), and a variant first met mid-serving stalls its step for the ~1 s of the compile
(a burst of 49 four-token extends on a 10k-token prefix did). So Q > 1 takes the decode
kernel only where a runner verifies drafts (`max_decode_query_len` 8, whose verify graphs
compile those variants at start); elsewhere it is 1 and same-length extends take the prefill
kernel, whose variants the start-up warm-up compiles.

Metadata comes in two forms; `forward` accepts either.

1. `build_metadata(query_lens, starts, block_tables, slot_mapping, *, context_lens=None,
   query_start_loc=None, host_block_tables=None, shared_prefix=None, shared_prefix_len=None)` ->
   `TritonAttentionMetadata` for eager steps. block_tables int32 (int64 is cast), slot_mapping
   int64 with -1 for padded rows. Pass the int32 device tensors `context_lens` [B] (= starts +
   query_lens), `query_start_loc` [B + 1] and `shared_prefix` [1] when they are already
   staged; otherwise they are built here with one small host-to-device copy each. The shared
   prefix is found on `host_block_tables` (block tables on the CPU serve as their own);
   without a host copy of device tables, never; `shared_prefix_len`, when the staging found it
   already, is taken as it is. `metadata_for(layout)` passes the views and the length
   worker/attention/step_inputs.py staged: the runner's way.

2. `DecodeMetadata`, tensors only, for decode steps captured in a CUDA graph (`PrefillMetadata`
   is its counterpart for prefill steps). The runner owns persistent buffers, fills them in
   place before each replay, and passes the same object (or one holding the same tensors) at
   capture and replay:

       block_tables  int32 [B, max_blocks]   row b: sequence b's block ids; padding rows: 0s
       context_lens  int32 [B]               tokens in the cache after this step's write,
                                             the Q new ones included; 0 for a padding row
       slot_mapping  int64 [B * Q]           slot of each q/k/v row (sequence b owns rows
                                             b*Q .. b*Q+Q-1); -1 for padding rows
       query_len     int  Q                  static
       num_splits    int | None              static; None: default_num_splits(B, kv heads,
                                             max_blocks * block_size), fixed by the shapes

   q/k/v then have exactly B * Q rows. Nothing in the decode path reads device values on
   the host or sizes a launch from them, so capture and replay are valid for any
   context_lens <= max_blocks * block_size. Padding rows produce zeros.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from spillway.kernels.cascade_attention import SUFFIX_ROWS, cascade_attention, cascade_num_splits, suffix_rows_for
from spillway.kernels.kv_write import write_kv
from spillway.kernels.paged_attention_decode import paged_decode_attention
from spillway.kernels.paged_attention_prefill import paged_prefill_attention, prefill_num_splits
from spillway.kernels.utils import multiprocessor_count
from spillway.worker.attention.torch_paged import AttentionBackend, AttentionMetadata
from spillway.worker.attention.shared_prefix import shared_prefix_len as find_shared_prefix
from spillway.worker.attention.step_inputs import StepLayout


@dataclass(slots=True)
class DecodeMetadata:
    """A decode step's tensors; see the module docstring for shapes and the CUDA-graph contract."""

    block_tables: torch.Tensor
    context_lens: torch.Tensor
    slot_mapping: torch.Tensor
    query_len: int = 1
    num_splits: int | None = None


@dataclass(slots=True)
class PrefillMetadata:
    """A ragged step's tensors for `paged_prefill_attention`, or with `shared_prefix` set for
    `cascade_attention`.

    Passed to `forward`/`attend` on its own (with `slot_mapping` set), it is the tensors-only
    form of a prefill step captured in a CUDA graph: q/k/v have `max_query_len` rows, the
    padding sequences have no new tokens (equal `query_start_loc` entries) and a context of 0,
    padding rows have slot -1. Rows past the last sequence's come back unspecified. A cascade
    graph is valid for any staged prefix length, 0 included (kernels/cascade_attention.py).
    Its static cascade fields serve that form only: inside `TritonAttentionMetadata` (an eager
    step), `attend` picks both from the step's rows, prefix and longest query (`max_query_len`).
    """

    query_start_loc: torch.Tensor  # int32 [B + 1]
    seq_lens: torch.Tensor  # int32 [B]
    block_tables: torch.Tensor  # int32 [B, max_blocks]
    max_query_len: int
    slot_mapping: torch.Tensor | None = None  # int64 or int32 [rows], -1 for a padded row
    num_splits: int = 1  # static: key splits (kernels/paged_attention_prefill.py)
    shared_prefix: torch.Tensor | None = None  # int32 [1]: the prefix every sequence shares; None: no cascade
    cascade_splits: int = 1  # static: the shared prefix's key splits (kernels/cascade_attention.py)
    cascade_suffix_rows: int = SUFFIX_ROWS  # static: its suffix pass's rows a program (`suffix_rows_for`)


def graph_prefill_metadata(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                           slot_mapping: torch.Tensor, num_rows: int, *, num_heads: int, num_kv_heads: int,
                           head_dim: int, shared_prefix: torch.Tensor | None = None,
                           max_prefix_len: int = 0, cascade_suffix_rows: int = SUFFIX_ROWS) -> PrefillMetadata:
    """The tensors-only metadata of a prefill step captured in a graph of `num_rows` rows, its
    key splits chosen from the static shapes: a few new tokens after a long cached prefix are
    spread over the multiprocessors instead of walking the context on a handful. With
    `shared_prefix` (the staged int32 [1] length of a prefix every sequence shares, at most
    `max_prefix_len`), its attention is cascade attention, the prefix's splits sized for
    `max_prefix_len` (shorter prefixes leave the last splits empty), its suffix pass at
    `cascade_suffix_rows` rows a program: SHORT_SUFFIX_ROWS in a twin only replayed for steps
    whose every query is at most `short_query_tokens` long (the shapes cannot tell)."""
    num_sms = multiprocessor_count(block_tables.device)
    group = num_heads // num_kv_heads
    num_splits = prefill_num_splits(num_rows, block_tables.shape[0], num_kv_heads, group, head_dim, num_sms)
    cascade_splits = cascade_num_splits(num_rows, num_kv_heads, group, head_dim, max_prefix_len, num_sms)
    return PrefillMetadata(query_start_loc, seq_lens, block_tables, num_rows, slot_mapping, num_splits,
                           shared_prefix, cascade_splits, cascade_suffix_rows)


@dataclass(slots=True)
class TritonAttentionMetadata(AttentionMetadata):
    """Exactly one of `decode` and `prefill` is set; `shared_prefix_len` > 0 (prefill set) runs
    cascade_attention over the prefill tensors."""

    decode: DecodeMetadata | None
    prefill: PrefillMetadata | None
    shared_prefix_len: int = 0


class TritonAttentionBackend(AttentionBackend):
    """Paged attention with the Triton kernels; q/k/v may be strided views of a fused qkv."""

    def __init__(self, block_size: int, scale: float | None = None, max_decode_query_len: int = 1) -> None:
        super().__init__(block_size, scale)
        self.max_decode_query_len = max_decode_query_len

    def build_metadata(
        self,
        query_lens: list[int],
        starts: list[int],
        block_tables: torch.Tensor,
        slot_mapping: torch.Tensor,
        *,
        context_lens: torch.Tensor | None = None,
        query_start_loc: torch.Tensor | None = None,
        host_block_tables: np.ndarray | torch.Tensor | None = None,
        shared_prefix: torch.Tensor | None = None,
        shared_prefix_len: int | None = None,
    ) -> TritonAttentionMetadata:
        """`context_lens` int32 [B] (starts + query_lens) and `query_start_loc` int32 [B + 1],
        when the runner already has them on the device, save building and copying them here;
        `host_block_tables`, a host copy of block_tables, lets a shared prefix be found, and
        `shared_prefix`, int32 [1] on the device, holds its length when it was staged
        (`shared_prefix_len`, found by the staging: not looked for again)."""
        assert query_lens and all(n > 0 for n in query_lens), "every sequence needs at least one new token"
        device = slot_mapping.device
        row_starts = [0, *itertools.accumulate(query_lens)]
        seq_lens = [start + n for start, n in zip(starts, query_lens)]
        tables = block_tables.to(torch.int32)
        decode = prefill = None
        query_len = query_lens[0]
        num_seqs = len(query_lens)
        if host_block_tables is None and block_tables.device.type == "cpu":
            host_block_tables = block_tables
        shared = shared_prefix_len
        if shared is None:
            shared = 0 if host_block_tables is None else find_shared_prefix(starts, host_block_tables, self.block_size)
        if not shared and query_len <= self.max_decode_query_len and all(n == query_len for n in query_lens):
            if context_lens is None:
                context_lens = torch.tensor(seq_lens, dtype=torch.int32).to(device, non_blocking=True)
            decode = DecodeMetadata(tables, context_lens, slot_mapping, query_len)
        else:
            if context_lens is None or query_start_loc is None:
                packed = torch.tensor(row_starts + seq_lens, dtype=torch.int32).to(device, non_blocking=True)
                query_start_loc, context_lens = packed[: num_seqs + 1], packed[num_seqs + 1 :]
            prefill = PrefillMetadata(query_start_loc, context_lens, tables, max(query_lens))
            if shared:
                prefill.shared_prefix = (shared_prefix if shared_prefix is not None else
                                         torch.tensor([shared], dtype=torch.int32).to(device, non_blocking=True))
        return TritonAttentionMetadata(
            query_lens, starts, row_starts, block_tables, slot_mapping, decode=decode, prefill=prefill,
            shared_prefix_len=shared,
        )

    def metadata_for(self, layout: StepLayout) -> TritonAttentionMetadata:
        """The step's metadata over the views `layout` staged on the device in the step's one
        host-to-device copy: nothing is built or copied again."""
        return self.build_metadata(layout.query_lens, layout.starts, layout.block_tables, layout.slot_mapping,
                                   context_lens=layout.context_lens, query_start_loc=layout.query_start_loc,
                                   shared_prefix=layout.shared_prefix, shared_prefix_len=layout.shared_prefix_len)

    def forward(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata | DecodeMetadata | PrefillMetadata,
    ) -> torch.Tensor:
        write_kv(k, v, kv_cache, layer_idx, metadata.slot_mapping)
        return self.attend(layer_idx, q, kv_cache, metadata)

    def attend(
        self, layer_idx: int, q: torch.Tensor, kv_cache: torch.Tensor,
        metadata: AttentionMetadata | DecodeMetadata | PrefillMetadata,
    ) -> torch.Tensor:
        """Attention of q over the cache, this step's k/v already stored in it: the kernels
        read every key and value from the cache, never from k/v."""
        scale = self.scale if self.scale is not None else q.shape[-1] ** -0.5
        if isinstance(metadata, DecodeMetadata):
            return self._decode(layer_idx, q, kv_cache, metadata, scale)
        if isinstance(metadata, PrefillMetadata):
            return self._ragged(layer_idx, q, kv_cache, metadata, scale, metadata.cascade_splits,
                                metadata.cascade_suffix_rows)
        assert isinstance(metadata, TritonAttentionMetadata)
        if metadata.decode is not None:
            return self._decode(layer_idx, q, kv_cache, metadata.decode, scale)
        cascade_splits, suffix_rows = 1, SUFFIX_ROWS
        if metadata.shared_prefix_len:  # an eager step: its splits fit its rows and prefix, its tiles its queries
            num_kv_heads = kv_cache.shape[4]
            group, head_dim = q.shape[1] // num_kv_heads, q.shape[2]
            cascade_splits = cascade_num_splits(q.shape[0], num_kv_heads, group, head_dim,
                                                metadata.shared_prefix_len, multiprocessor_count(kv_cache.device))
            suffix_rows = suffix_rows_for(metadata.prefill.max_query_len, group, head_dim)
        out = self._ragged(layer_idx, q, kv_cache, metadata.prefill, scale, cascade_splits, suffix_rows)
        num_rows = metadata.query_start_loc[-1]
        if q.shape[0] > num_rows:
            out[num_rows:].zero_()
        return out

    @staticmethod
    def _ragged(layer_idx: int, q: torch.Tensor, kv_cache: torch.Tensor, prefill: PrefillMetadata, scale: float,
                cascade_splits: int, suffix_rows: int) -> torch.Tensor:
        arguments = (q, kv_cache, layer_idx, prefill.query_start_loc, prefill.seq_lens, prefill.block_tables,
                     scale, prefill.max_query_len)
        if prefill.shared_prefix is not None:
            return cascade_attention(*arguments, prefill.shared_prefix, cascade_splits, suffix_rows=suffix_rows)
        return paged_prefill_attention(*arguments, prefill.num_splits)

    @staticmethod
    def _decode(
        layer_idx: int, q: torch.Tensor, kv_cache: torch.Tensor, decode: DecodeMetadata, scale: float
    ) -> torch.Tensor:
        num_seqs, query_len = decode.context_lens.shape[0], decode.query_len
        num_rows, num_heads, head_dim = num_seqs * query_len, q.shape[1], q.shape[2]
        out = paged_decode_attention(
            q[:num_rows].view(num_seqs, query_len, num_heads, head_dim), kv_cache, layer_idx,
            decode.block_tables, decode.context_lens, scale, decode.num_splits,
        ).view(num_rows, num_heads, head_dim)
        if q.shape[0] == num_rows:
            return out
        padded = q.new_zeros(q.shape)
        padded[:num_rows] = out
        return padded
