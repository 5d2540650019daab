"""Turns a step's chunks into one forward pass over the paged KV cache.

A step, on any device:

    chunks ──► StepInputs: numpy writes into one persistent int32 host buffer (pinned on
               CUDA), then one host→device copy
           ──► a decode batch that fits a captured bucket: replay that bucket's CUDA graph
               (worker/cuda_graphs.py) over the bucket's fixed input views, rows padded;
               a prefill/mixed step of at most 512 tokens: the graph of its token bucket;
               anything else (larger steps, enforce_eager, CPU): run the model eagerly
           ──► float32 logits of each chunk's last token

Nothing on this path reads device memory back; the sampler's copy of the sampled tokens is
the step's only synchronisation.

On CUDA the executor (worker/executor.py) builds the runner without a KV cache, measures the
peak of one max_num_batched_tokens step (`profile_peak_memory`), sizes the pool from what is
left (`allocate_kv_cache`), then captures the decode and prefill graphs (`capture_graphs`). An eager step's
attention metadata reads the views staged here (`AttentionBackend.metadata_for`): the step's
inputs reach the device once.
"""

from __future__ import annotations

import functools
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
        self.graphs = None  # decode StepGraphs (by batch size) once captured
        self.prefill_graphs = None  # prefill StepGraphs (by token count) once captured
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
        to verify: always eager, the graphs keep one row per sequence). The result
        may be a view of a buffer that the next step overwrites.
        """
        assert chunks, "a step needs at least one chunk"
        self._check_contexts(chunks)
        graphs = self.graphs
        num_tokens = sum(len(chunk.token_ids) for chunk in chunks)
        if graphs is not None and logits_rows is None and num_tokens == len(chunks) <= graphs.max_bucket:
            bucket = graphs.bucket_for(len(chunks))
            self.inputs.stage_decode(chunks, bucket)
            if feed is not None:
                self._feed(self.inputs.decode_layout(bucket).input_ids, feed)
            return graphs.replay(bucket)[: len(chunks)]
        if feed is not None:
            assert all(len(chunks[row].token_ids) == 1 for row in feed.rows), "fed chunks have one token"
        # Verification reads several rows per chunk: the graphs keep one (the last) per chunk.
        bucket = self._prefill_bucket(num_tokens, len(chunks)) if logits_rows is None else None
        if bucket is not None:
            layout = self.inputs.stage_prefill(chunks, bucket, self._prefill_graph_seqs(bucket))
            if feed is not None:
                self._feed(layout.input_ids, feed, layout.last_rows)
            return self.prefill_graphs.replay(bucket)[: len(chunks)]
        layout = self.inputs.stage(chunks)
        if feed is not None:
            self._feed(layout.input_ids, feed, layout.last_rows)
        if logits_rows is not None:
            return self._forward(layout, torch.tensor(logits_rows, device=self.device))
        return self._forward(layout)

    def _prefill_bucket(self, num_tokens: int, num_seqs: int) -> int | None:
        """The smallest captured prefill bucket that holds the step, or None."""
        graphs = self.prefill_graphs
        if graphs is None or num_tokens > graphs.max_bucket:
            return None
        for bucket in graphs.buckets[graphs.buckets.index(graphs.bucket_for(num_tokens)):]:
            if num_seqs <= self._prefill_graph_seqs(bucket):
                return bucket
        return None

    def _prefill_graph_seqs(self, bucket: int) -> int:
        from spillway.worker.cuda_graphs import prefill_graph_seqs

        return prefill_graph_seqs(bucket, self.max_num_seqs)

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

    @torch.inference_mode()
    def warm_up(self, num_tokens: int = 513) -> None:
        """Compile the eager path's kernel variants before the first request: Triton
        specialises integer arguments on divisibility by 16, and the profiling step (8,192
        tokens) compiled only one side, so a prompt of another length would compile kernels
        inside its first token. One eager step of `num_tokens` (odd, past every prefill graph)
        over the pool's first blocks, which no request holds yet; their slots get finite values
        that every later context overwrites before reading."""
        assert self.kv_cache is not None, "allocate the KV cache first"
        num_tokens = min(num_tokens, self.inputs.capacity[0])
        num_blocks = math.ceil(num_tokens / self.block_size)
        if num_blocks > min(self.kv_cache.shape[0], self.max_blocks_per_seq):
            return
        self._forward(self.inputs.stage([ChunkInput([0] * num_tokens, 0, list(range(num_blocks)))]))

    def capture_graphs(self, max_batch_size: int) -> None:
        """Capture the decode step for every batch-size bucket up to `max_batch_size`, then the
        prefill step for every token bucket the step budget allows, into one memory pool."""
        from spillway.worker.cuda_graphs import StepGraphs, decode_buckets, decode_step, prefill_buckets, prefill_step

        assert self.kv_cache is not None, "allocate the KV cache first"
        pool = torch.cuda.graph_pool_handle()
        graphs = StepGraphs(decode_buckets(min(max_batch_size, self.max_num_seqs)), self.device)
        graphs.capture(functools.partial(decode_step, self), self.inputs.pad_decode, pool)
        self.graphs = graphs
        buckets = prefill_buckets(self.inputs.capacity[0])
        if buckets:
            prefill = StepGraphs(buckets, self.device, kind="prefill")
            prefill.capture(functools.partial(prefill_step, self),
                            lambda bucket: self.inputs.pad_prefill(bucket, self._prefill_graph_seqs(bucket)), pool)
            self.prefill_graphs = prefill

    def logits_rows(self, rows: int) -> torch.Tensor:
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
