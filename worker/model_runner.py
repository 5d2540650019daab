"""Turns a step's chunks into one forward pass over the paged KV cache."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from torch import nn

from spillway.worker.attention import AttentionBackend, TorchAttentionBackend


@dataclass(slots=True)
class ChunkInput:
    """New tokens of one request at positions `start .. start + len(token_ids) - 1`.

    The KV of positions before `start` is already in the blocks of `block_table`, which
    covers at least `start + len(token_ids)` tokens.
    """

    token_ids: list[int]
    start: int
    block_table: list[int]


def _kv_dims(config) -> tuple[int, int, int]:
    num_heads = config.num_attention_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    return config.num_hidden_layers, num_kv_heads, head_dim


def kv_block_bytes(config, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one KV block: `block_size` tokens' keys and values in every layer."""
    num_layers, num_kv_heads, head_dim = _kv_dims(config)
    return num_layers * 2 * block_size * num_kv_heads * head_dim * dtype.itemsize


def num_blocks_for_memory(config, block_size: int, dtype: torch.dtype, memory_bytes: int) -> int:
    """How many KV blocks fit in `memory_bytes`."""
    return max(0, int(memory_bytes) // kv_block_bytes(config, block_size, dtype))


class ModelRunner:
    """Owns the KV cache and runs the model over a batch of chunks, one step at a time.

    `kv_cache` is `[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`, zeroed
    so that masked-out slots never hold NaN.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
        backend: AttentionBackend | None = None,
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.device = torch.device(device)
        self.backend = backend or TorchAttentionBackend(block_size)
        self.max_context_len = model.sliding_window
        shape = (num_blocks, model.num_layers, 2, block_size, model.num_kv_heads, model.head_dim)
        self.kv_cache = torch.zeros(shape, device=self.device, dtype=dtype)

    @torch.inference_mode()
    def execute(self, chunks: list[ChunkInput]) -> torch.Tensor:
        """float32 logits `[len(chunks), vocab]` for the last token of each chunk."""
        assert chunks, "a step needs at least one chunk"
        query_lens = [len(chunk.token_ids) for chunk in chunks]
        starts = [chunk.start for chunk in chunks]
        device = self.device
        input_ids = torch.tensor(
            list(itertools.chain.from_iterable(chunk.token_ids for chunk in chunks)), device=device
        )
        block_tables = self._block_tables(chunks, query_lens)
        positions, slot_mapping = self._positions_and_slots(query_lens, starts, block_tables)
        metadata = self.backend.build_metadata(query_lens, starts, block_tables, slot_mapping)

        hidden = self.model(input_ids, positions, self.kv_cache, self.backend, metadata)
        last_rows = torch.tensor(list(itertools.accumulate(query_lens)), device=device) - 1
        return self.model.compute_logits(hidden[last_rows])

    def _block_tables(self, chunks: list[ChunkInput], query_lens: list[int]) -> torch.Tensor:
        """`[num_chunks, max_blocks]` int64: each table cut to the blocks its context needs, 0-padded."""
        context_lens = [chunk.start + n for chunk, n in zip(chunks, query_lens)]
        if self.max_context_len is not None and max(context_lens) > self.max_context_len:
            raise ValueError(
                f"a context of {max(context_lens)} tokens exceeds the model's sliding window of "
                f"{self.max_context_len}, which is not implemented"
            )
        needed = [-(-context_len // self.block_size) for context_len in context_lens]
        width = max(needed)
        rows = []
        for chunk, context_len, num_blocks in zip(chunks, context_lens, needed):
            if len(chunk.block_table) < num_blocks:
                raise ValueError(
                    f"a block table of {len(chunk.block_table)} blocks cannot hold {context_len} tokens"
                )
            rows.append(chunk.block_table[:num_blocks] + [0] * (width - num_blocks))
        return torch.tensor(rows, dtype=torch.int64, device=self.device)

    def _positions_and_slots(
        self, query_lens: list[int], starts: list[int], block_tables: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        device = self.device
        lens = torch.tensor(query_lens, device=device)
        first_rows = itertools.accumulate([0] + query_lens)
        row_offsets = [start - first_row for start, first_row in zip(starts, first_rows)]
        seq_of_row = torch.repeat_interleave(torch.arange(len(query_lens), device=device), lens)
        positions = torch.arange(int(sum(query_lens)), device=device)
        positions += torch.repeat_interleave(torch.tensor(row_offsets, device=device), lens)
        blocks = block_tables[seq_of_row, torch.div(positions, self.block_size, rounding_mode="floor")]
        return positions, blocks * self.block_size + positions % self.block_size
