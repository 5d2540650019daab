"""Multi-head latent attention (MLA, worker/models/mla.py) through the Triton kernels: the CUDA
backend of a model whose cache holds one latent row a token.

The model calls `forward(layer_idx, q, rows, None, kv_cache, metadata)` with q `[rows, heads, D]`
(every head's `[q_nope @ W_UK | q_pe]`) and the new tokens' rows `[rows, 1, D]`,
`D = kv_lora_rank + rope_dim`; the rows are stored in the one-sided cache (kernels/kv_write.py)
and every head attends to its sequence's rows, keys the whole rows and values their first
kv_lora_rank values. It returns `[rows, heads, kv_lora_rank]`. Which kernel runs:

    every sequence has the same query length Q <= max_decode_query_len
        -> paged_mla_decode     (kernels/mla_decode.py: decode, or k + 1 verified queries)
    anything else (prefill, extend, mixed prefill + decode)
        -> paged_mla_prefill    (kernels/mla_prefill.py: ragged)

The metadata are `TritonAttentionBackend`'s (worker/attention/triton_paged.py), built by one
held here, in all three forms (eager steps, decode graphs, prefill graphs), so the runner's
staging and graphs serve an MLA model unchanged. A shared prefix is never looked for (the
latent kernels have no cascade pass): a prefill graph's cascade variant runs as plain prefill.
"""

from __future__ import annotations

import torch

from spillway.kernels.kv_write import write_kv
from spillway.kernels.mla_decode import paged_mla_decode
from spillway.kernels.mla_prefill import paged_mla_prefill
from spillway.worker.attention.step_inputs import StepLayout
from spillway.worker.attention.torch_paged import AttentionBackend, AttentionMetadata
from spillway.worker.attention.triton_paged import (
    DecodeMetadata,
    PrefillMetadata,
    TritonAttentionBackend,
    TritonAttentionMetadata,
)


class LatentAttentionBackend(AttentionBackend):
    """MLA attention over a latent cache with the Triton kernels (module doc)."""

    def __init__(self, block_size: int, kv_lora_rank: int, scale: float, max_decode_query_len: int = 1) -> None:
        super().__init__(block_size, scale)
        self.kv_lora_rank = kv_lora_rank
        self._layouts = TritonAttentionBackend(block_size, scale, max_decode_query_len)

    @property
    def max_decode_query_len(self) -> int:
        return self._layouts.max_decode_query_len

    def build_metadata(self, query_lens: list[int], starts: list[int], block_tables: torch.Tensor,
                       slot_mapping: torch.Tensor, **staged) -> TritonAttentionMetadata:
        """`TritonAttentionBackend.build_metadata`, never with a shared prefix."""
        staged.update(shared_prefix=None, shared_prefix_len=0, host_block_tables=None)
        return self._layouts.build_metadata(query_lens, starts, block_tables, slot_mapping, **staged)

    def metadata_for(self, layout: StepLayout) -> TritonAttentionMetadata:
        return self.build_metadata(layout.query_lens, layout.starts, layout.block_tables, layout.slot_mapping,
                                   context_lens=layout.context_lens, query_start_loc=layout.query_start_loc)

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None,
                kv_cache: torch.Tensor, metadata: AttentionMetadata | DecodeMetadata | PrefillMetadata) -> torch.Tensor:
        if v is not None:
            raise ValueError("a latent cache stores one row a token: v must be None")
        write_kv(k, None, kv_cache, layer_idx, metadata.slot_mapping)
        return self.attend(layer_idx, q, kv_cache, metadata)

    def attend(self, layer_idx: int, q: torch.Tensor, kv_cache: torch.Tensor,
               metadata: AttentionMetadata | DecodeMetadata | PrefillMetadata) -> torch.Tensor:
        if isinstance(metadata, TritonAttentionMetadata):
            metadata = metadata.decode if metadata.decode is not None else metadata.prefill
        if isinstance(metadata, DecodeMetadata):
            return self._decode(layer_idx, q, kv_cache, metadata)
        assert isinstance(metadata, PrefillMetadata), f"unknown metadata {type(metadata).__name__}"
        return paged_mla_prefill(q, kv_cache, layer_idx, metadata.query_start_loc, metadata.seq_lens,
                                 metadata.block_tables, kv_lora_rank=self.kv_lora_rank, scale=self.scale,
                                 max_query_len=metadata.max_query_len)

    def _decode(self, layer_idx: int, q: torch.Tensor, kv_cache: torch.Tensor, decode: DecodeMetadata) -> torch.Tensor:
        num_seqs, query_len = decode.context_lens.shape[0], decode.query_len
        num_rows, num_heads, width = num_seqs * query_len, q.shape[1], q.shape[2]
        out = paged_mla_decode(q[:num_rows].view(num_seqs, query_len, num_heads, width), kv_cache, layer_idx,
                               decode.block_tables, decode.context_lens, kv_lora_rank=self.kv_lora_rank,
                               scale=self.scale, num_splits=decode.num_splits)
        out = out.view(num_rows, num_heads, self.kv_lora_rank)
        if q.shape[0] == num_rows:
            return out
        padded = out.new_zeros(q.shape[0], num_heads, self.kv_lora_rank)
        padded[:num_rows] = out
        return padded
