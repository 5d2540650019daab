"""Turns a step's chunks into one forward pass over the paged KV cache.

A step, on any device:

    chunks ──► StepInputs: numpy writes into one persistent int32 host buffer (pinned on
               CUDA), then one host→device copy
           ──► a decode batch that fits a captured bucket: replay that bucket's CUDA graph
               (worker/cuda_graphs.py) over the bucket's fixed input views, rows padded;
               anything else (prefill, mixed, enforce_eager, CPU): run the model eagerly
           ──► float32 logits of each chunk's last token

Nothing on this path reads device memory back; the sampler's copy of the sampled tokens is
the step's only synchronisation.

On CUDA the executor (worker/executor.py) builds the runner without a KV cache, measures the
peak of one max_num_batched_tokens step (`profile_peak_memory`), sizes the pool from what is
left (`allocate_kv_cache`), then captures the decode graphs (`capture_graphs`). An eager step's
attention metadata reads the views staged here (`AttentionBackend.metadata_for`): the step's
inputs reach the device once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from spillway.worker.attention import AttentionBackend, TorchAttentionBackend
from spillway.worker.step_inputs import StepInputs, StepLayout


@dataclass(slots=True)
class ChunkInput:
    """New tokens of one request at positions `start .. start + len(token_ids) - 1`.

    The KV of positions before `start` is already in the GPU slots of `slot_table`, which
    covers at least `start + len(token_ids)` tokens.
    """

    token_ids: list[int]
    start: int
    slot_table: list[int]


@dataclass(slots=True)
class TokenFeed:
    """Input tokens that are still on the device: chunk `rows[i]`'s token is
    `tokens[sources[i]]` (the sampled ids of the step before, not yet read by the host).
    Those chunks carry a placeholder in `token_ids`."""

    rows: list[int]
    sources: list[int]
    tokens: torch.Tensor


def _kv_dims(config) -> tuple[int, int, int]:
    num_heads = config.num_attention_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    return config.num_hidden_layers, num_kv_heads, head_dim


def kv_block_bytes(config, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one KV block: `block_size` tokens' keys and values in every layer, in the
    cache's `dtype` (one byte each for float8)."""
    num_layers, num_kv_heads, head_dim = _kv_dims(config)
    return num_layers * 2 * block_size * num_kv_heads * head_dim * dtype.itemsize


def num_blocks_for_memory(config, block_size: int, dtype: torch.dtype, memory_bytes: int) -> int:
    """How many KV blocks of the cache's `dtype` fit in `memory_bytes`."""
    return max(0, int(memory_bytes) // kv_block_bytes(config, block_size, dtype))


def default_backend(device: torch.device, block_size: int) -> AttentionBackend:
    """The Triton kernels on CUDA, plain torch elsewhere."""
    if device.type == "cuda":
        from spillway.worker.attention_triton import TritonAttentionBackend

        return TritonAttentionBackend(block_size)
    return TorchAttentionBackend(block_size)


class ModelRunner:
    """Owns the KV cache and runs the model over a batch of chunks, one step at a time.

    `kv_cache` is `[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`, zeroed
    so that masked-out slots never hold NaN. Without `num_blocks` it is allocated later by
    `allocate_kv_cache`, after `profile_peak_memory` has measured what the model needs.
    Its dtype is `kv_cache_dtype`, by default the model's `dtype`; float8 e4m3 needs the
    Triton kernels (kernels/fp8.py).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        num_blocks: int | None,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
        kv_cache_dtype: torch.dtype | None = None,
        backend: AttentionBackend | None = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 8192,
        max_model_len: int | None = None,
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.device = torch.device(device)
        self.dtype = dtype
        self.kv_cache_dtype = kv_cache_dtype or dtype
        self.backend = backend or default_backend(self.device, block_size)
        if self.kv_cache_dtype != dtype and isinstance(self.backend, TorchAttentionBackend):
            raise ValueError(f"an fp8 KV cache needs CUDA (the Triton kernels): the plain-torch attention "
                             f"stores the model's dtype, {dtype}")
        self.max_context_len = model.sliding_window
        self.max_num_seqs = max_num_seqs
        max_model_len = max_model_len or max_num_batched_tokens
        self.max_blocks_per_seq = math.ceil(max_model_len / block_size)
        model.rotary.reserve_positions(self.max_blocks_per_seq * block_size)
        self.inputs = StepInputs(
            max_num_tokens=max(max_num_batched_tokens, max_num_seqs),
            max_num_seqs=max_num_seqs,
            max_blocks_per_seq=self.max_blocks_per_seq,
            block_size=block_size,
            device=self.device,
        )
        self.graphs = None  # DecodeGraphs once captured
        self._graph_logits: torch.Tensor | None = None  # their shared logits buffer
        self.kv_cache: torch.Tensor | None = None
        if num_blocks is not None:
            self.allocate_kv_cache(num_blocks)

    @property
    def kv_cache_shape(self) -> tuple[int, ...]:
        model = self.model
        return (model.num_layers, 2, self.block_size, model.num_kv_heads, model.head_dim)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        # Zeroed, not empty: the attention kernels read a float8 cache's slots past a context
        # in its last block, which must never hold NaN (kernels/fp8.py).
        self.kv_cache = torch.zeros((num_blocks, *self.kv_cache_shape), device=self.device, dtype=self.kv_cache_dtype)

    @torch.inference_mode()
    def execute(self, chunks: list[ChunkInput], feed: TokenFeed | None = None,
                logits_rows: list[int] | None = None) -> torch.Tensor:
        """float32 logits `[len(chunks), vocab]` for the last token of each chunk.

        `feed` takes some chunks' one token from the device (see `TokenFeed`). `logits_rows`:
        return the logits of these rows of the step's flattened tokens instead (draft tokens
        to verify: always eager, the decode graphs hold one query per sequence). The result
        may be a view of a buffer that the next step overwrites.
        """
        assert chunks, "a step needs at least one chunk"
        self._check_contexts(chunks)
        graphs = self.graphs
        if graphs is not None and logits_rows is None and len(chunks) <= graphs.max_batch_size and all(
            len(chunk.token_ids) == 1 for chunk in chunks
        ):
            bucket = graphs.bucket_for(len(chunks))
            self.inputs.stage_decode(chunks, bucket)
            if feed is not None:
                self._feed(self.inputs.decode_layout(bucket).input_ids, feed)
            return graphs.replay(bucket)[: len(chunks)]
        layout = self.inputs.stage(chunks)
        if feed is not None:
            assert all(len(chunks[row].token_ids) == 1 for row in feed.rows), "fed chunks have one token"
            self._feed(layout.input_ids, feed, layout.last_rows)
        if logits_rows is not None:
            return self._forward(layout, torch.tensor(logits_rows, device=self.device))
        return self._forward(layout)

    @staticmethod
    def _feed(input_ids: torch.Tensor, feed: TokenFeed, last_rows: torch.Tensor | None = None) -> None:
        """Overwrite the fed chunks' input rows with their tokens, on the device, in stream order."""
        rows, sources = feed.rows, feed.sources
        if rows == sources and rows[-1] == len(rows) - 1 and last_rows is None:
            input_ids[: len(rows)].copy_(feed.tokens[: len(rows)])  # chunks 0..n-1 in order: the usual case
            return
        device = input_ids.device
        index = torch.tensor(rows, device=device)
        if last_rows is not None:  # a chunk's (only) row is its last row
            index = last_rows.index_select(0, index.to(last_rows.device)).long()
        tokens = feed.tokens.index_select(0, torch.tensor(sources, device=feed.tokens.device))
        input_ids.index_copy_(0, index, tokens.to(input_ids.dtype))

    def _forward(self, layout: StepLayout, logits_rows: torch.Tensor | None = None) -> torch.Tensor:
        metadata = self.backend.metadata_for(layout)
        hidden = self.model(layout.input_ids, layout.positions, self.kv_cache, self.backend, metadata)
        return self.model.compute_logits(hidden[layout.last_rows if logits_rows is None else logits_rows])

    def _check_contexts(self, chunks: list[ChunkInput]) -> None:
        if self.max_context_len is None:
            return
        longest = max(chunk.start + len(chunk.token_ids) for chunk in chunks)
        if longest > self.max_context_len:
            raise ValueError(
                f"a context of {longest} tokens exceeds the model's sliding window of "
                f"{self.max_context_len}, which is not implemented"
            )

    # ---- start-up on CUDA ------------------------------------------------------------------

    @torch.inference_mode()
    def profile_peak_memory(self, num_tokens: int, max_model_len: int) -> int:
        """Peak bytes a step of `num_tokens` prefill tokens allocates beyond the weights.

        Runs one forward of that many tokens (sequences of at most `max_model_len - 1`
        tokens) into a throwaway KV cache, then logits and a sort for `max_num_seqs` rows as
        the sampler would. The throwaway cache itself is not counted.
        """
        assert self.device.type == "cuda" and self.kv_cache is None
        seq_len = max(1, min(num_tokens, max_model_len - 1))
        lengths = [seq_len] * (num_tokens // seq_len) + ([num_tokens % seq_len] if num_tokens % seq_len else [])
        lengths = lengths[: self.max_num_seqs]
        blocks = [math.ceil(n / self.block_size) for n in lengths]
        self.allocate_kv_cache(sum(blocks))
        tables, first = [], 0
        for count in blocks:
            tables.append(list(range(first, first + count)))
            first += count
        chunks = [ChunkInput([0] * n, 0, table) for n, table in zip(lengths, tables)]
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        self._forward(self.inputs.stage(chunks))
        hidden = torch.zeros(self.max_num_seqs, self.model.spec.hidden_size, device=self.device, dtype=self.dtype)
        self.model.compute_logits(hidden).softmax(dim=-1).sort(dim=-1)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base
        self.kv_cache = None
        torch.cuda.empty_cache()
        return peak

    def capture_graphs(self, max_batch_size: int) -> None:
        """Capture the decode step for every batch-size bucket up to `max_batch_size`."""
        from spillway.worker.cuda_graphs import DecodeGraphs, decode_buckets

        assert self.kv_cache is not None, "allocate the KV cache first"
        graphs = DecodeGraphs(decode_buckets(min(max_batch_size, self.max_num_seqs)), self.device)
        graphs.capture(self._decode_step_for, self.inputs.pad_decode)
        self.graphs = graphs

    def _logits_rows(self, rows: int) -> torch.Tensor:
        """The first `rows` rows of the decode steps' shared float32 logits buffer.

        Every graph writes its logits there: a buffer per graph, kept alive by its graph, would
        hold sum(buckets) rows (10 GB for Qwen3-8B's vocabulary at max_num_seqs 512). One graph
        replays at a time, and its logits are consumed on the same stream before the next
        replay. Graphs are captured largest first, so the buffer is allocated once."""
        if self._graph_logits is None or self._graph_logits.shape[0] < rows:
            self._graph_logits = torch.empty(rows, self.model.spec.vocab_size, dtype=torch.float32,
                                             device=self.device)
        return self._graph_logits[:rows]

    @staticmethod
    def graph_logits_bytes(max_num_seqs: int, vocab_size: int) -> int:
        """What `capture_graphs` allocates for logits, beyond the activations' peak."""
        return max_num_seqs * vocab_size * 4

    def _decode_step_for(self, bucket: int):
        """A function running the decode step of `bucket` rows on the static input views."""
        from spillway.worker.attention_triton import DecodeMetadata

        layout = self.inputs.decode_layout(bucket)
        metadata = DecodeMetadata(layout.block_tables, layout.context_lens, layout.slot_mapping)
        model, kv_cache, backend = self.model, self.kv_cache, self.backend
        logits = self._logits_rows(bucket)

        def step() -> torch.Tensor:
            hidden = model(layout.input_ids, layout.positions, kv_cache, backend, metadata)
            return model.compute_logits(hidden, out=logits)

        return step
