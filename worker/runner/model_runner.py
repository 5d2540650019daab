"""Turns a step's chunks into one forward pass over the paged KV cache.

A step, on any device:

    chunks ──► StepInputs: numpy writes into one persistent int32 host buffer (pinned on
               CUDA), then one host→device copy
           ──► a decode batch that fits a captured bucket: replay that bucket's CUDA graph
               (worker/runner/cuda_graphs.py) over the bucket's fixed input views, rows padded;
               a prefill/mixed step of at most 2,048 tokens: the graph of its token bucket,
               its cascade twin where the step's sequences share a cached prefix, the
               cascade twin's short twin where moreover no query is longer than
               `short_query_tokens` (and the bucket has one);
               a step asking for `logits_rows` (verification, prompt logprobs) of at most
               256 tokens, with speculative decoding on: the verify graph of its token bucket;
               anything else (larger steps, enforce_eager, CPU): run the model eagerly;
               a step whose KV still lands from the CPU tier: its prefill graph's segments
               each after their layers (worker/kv_tier/step_graphs.py), or eagerly layer by layer
           ──► float32 logits of each chunk's last token, or of the `logits_rows` asked for

Nothing on this path reads device memory back; the sampler's copy of the sampled tokens is
the step's only synchronisation.

On CUDA the executor (worker/runner/executor.py) builds the runner without a KV cache, measures the
peak of one max_num_batched_tokens step (`Executor.kv_pool_blocks`), sizes the pool from what
is left (`allocate_kv_cache`), then captures the decode, prefill (and their cascade twins) and
(with speculative decoding) verify graphs (`capture_graphs`: the runner's `CudaGraphs`), then
runs the eager path's kernel variants once (`warm_up`). An eager step's attention metadata
reads the views staged here (`AttentionBackend.metadata_for`): the step's inputs reach the
device once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from spillway.kernels.cascade_attention import short_query_tokens
from spillway.worker.attention.shared_prefix import CASCADE_MIN_TOKENS
from spillway.worker.attention.step_inputs import StepInputs, StepLayout
from spillway.worker.attention.torch_paged import AttentionBackend, TorchAttentionBackend
from spillway.worker.runner.cuda_graphs import CudaGraphs


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


# The longest same-length query that takes the decode kernel where steps verify drafts
# (worker/attention/triton_paged.py: one compiled variant per length).
MAX_VERIFY_QUERY_LEN = 8


def default_backend(device: torch.device, block_size: int, verifies: bool = False,
                    scale: float | None = None, kv_lora_rank: int | None = None) -> AttentionBackend:
    """The Triton kernels on CUDA, plain torch elsewhere. `verifies`: steps will verify drafts
    (k + 1 queries a request), which the decode kernel serves up to MAX_VERIFY_QUERY_LEN.
    `scale`: the model's softmax scale (`attention_scale`), None for head_dim ** -0.5.
    `kv_lora_rank`: a latent-attention (MLA) model's (`latent_rank`), whose cache holds latent
    rows: on CUDA the latent kernels' backend (worker/attention/triton_latent.py)."""
    if device.type == "cuda":
        decode_query_len = MAX_VERIFY_QUERY_LEN if verifies else 1
        if kv_lora_rank is not None:
            from spillway.worker.attention.triton_latent import LatentAttentionBackend

            return LatentAttentionBackend(block_size, kv_lora_rank, scale, max_decode_query_len=decode_query_len)
        from spillway.worker.attention.triton_paged import TritonAttentionBackend

        return TritonAttentionBackend(block_size, scale=scale, max_decode_query_len=decode_query_len)
    return TorchAttentionBackend(block_size, scale=scale)


def latent_rank(model: nn.Module) -> int | None:
    """The kv_lora_rank of a latent-attention model's cache rows, None for any other."""
    mla = model.spec.mla
    return None if mla is None else mla.kv_lora_rank


class ModelRunner:
    """Owns the KV cache and runs the model over a batch of chunks, one step at a time.

    `kv_cache` is `[num_blocks, num_layers, kv_sides, block_size, num_kv_heads, head_dim]`
    (the model's sides: keys and values, or an MLA model's one latent row), zeroed
    so that masked-out slots never hold NaN. Without `num_blocks` it is allocated later by
    `allocate_kv_cache`, after the executor has measured what the model needs.
    Its dtype is `kv_cache_dtype`, by default the model's `dtype`; float8 e4m3 needs the
    Triton kernels (kernels/fp8.py). `cuda_graphs` holds the steps captured on CUDA
    (`capture_graphs`); a step that fits none runs eagerly.
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
        self.backend = backend or default_backend(self.device, block_size, scale=model.attention_scale,
                                                  kv_lora_rank=latent_rank(model))
        if self.backend.scale != model.attention_scale:
            raise ValueError(f"the attention backend's softmax scale {self.backend.scale} is not the model's "
                             f"{model.attention_scale} (default_backend's `scale`)")
        if self.kv_cache_dtype != dtype and isinstance(self.backend, TorchAttentionBackend):
            raise ValueError(f"an fp8 KV cache needs CUDA (the Triton kernels): the plain-torch attention "
                             f"stores the model's dtype, {dtype}")
        self.max_context_len = model.sliding_window
        self.max_num_seqs = max_num_seqs
        # The longest query that steps replaying a short cascade twin may have (worker/runner/cuda_graphs.py).
        self.short_query_tokens = short_query_tokens(model.spec.num_heads // model.num_kv_heads, model.head_dim)
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
        self.cuda_graphs = CudaGraphs(model, self.inputs, self.backend, device=self.device, max_num_seqs=max_num_seqs,
                                      max_prefix_len=self.max_blocks_per_seq * block_size,
                                      short_query_tokens=self.short_query_tokens)
        self.kv_cache: torch.Tensor | None = None
        if num_blocks is not None:
            self.allocate_kv_cache(num_blocks)

    @property
    def kv_cache_shape(self) -> tuple[int, ...]:
        model = self.model
        return (model.num_layers, model.kv_sides, self.block_size, model.num_kv_heads, model.head_dim)

    @property
    def kv_block_bytes(self) -> int:
        """Bytes of one block of this runner's pool: its model's KV heads (a tensor-parallel
        rank's share of them), every layer, in the cache's dtype."""
        return math.prod(self.kv_cache_shape) * self.kv_cache_dtype.itemsize

    def allocate_kv_cache(self, num_blocks: int) -> None:
        # Zeroed, not empty: the attention kernels read a float8 cache's slots past a context
        # in its last block, which must never hold NaN (kernels/fp8.py).
        self.kv_cache = torch.zeros((num_blocks, *self.kv_cache_shape), device=self.device, dtype=self.kv_cache_dtype)

    @torch.inference_mode()
    def execute(self, chunks: list[ChunkInput], feed: TokenFeed | None = None,
                logits_rows: list[int] | None = None, layer_ready: list[torch.cuda.Event] | None = None
                ) -> torch.Tensor:
        """float32 logits `[len(chunks), vocab]` for the last token of each chunk.

        `feed` takes some chunks' one token from the device (see `TokenFeed`). `logits_rows`:
        return the logits of these rows of the step's flattened tokens instead, in that order
        (draft tokens to verify, prompt logprobs: a verify graph, or eagerly). `layer_ready`:
        an event per layer (KV landing from the CPU tier): each graph segment or eager layer
        waits for its own. The result may be a view of a buffer the next step overwrites.
        """
        assert chunks, "a step needs at least one chunk"
        self._check_contexts(chunks)
        num_tokens = sum(len(chunk.token_ids) for chunk in chunks)
        if feed is not None:
            assert all(len(chunks[row].token_ids) == 1 for row in feed.rows), "fed chunks have one token"
        if logits_rows is not None:
            return self._execute_rows(chunks, feed, logits_rows, num_tokens, layer_ready)
        graphs = self.cuda_graphs
        decode = graphs.decode
        if decode is not None and num_tokens == len(chunks) <= decode.max_bucket and layer_ready is None:
            bucket = decode.bucket_for(len(chunks))
            self.inputs.stage_decode(chunks, bucket)
            if feed is not None:
                self._feed(self.inputs.decode_layout(bucket).input_ids, feed)
            return decode.replay(bucket)[: len(chunks)]
        bucket = graphs.token_bucket(graphs.prefill, num_tokens, len(chunks))
        if bucket is not None:
            layout = self.inputs.stage_prefill(chunks, bucket, graphs.graph_seqs(bucket, "prefill"))
            self._feed_rows(layout, feed)
            return graphs.prefill_for(bucket, layout).replay(bucket, layer_ready)[: len(chunks)]
        layout = self.inputs.stage(chunks)
        self._feed_rows(layout, feed)
        return self._forward(layout, None, layer_ready)

    def _execute_rows(self, chunks: list[ChunkInput], feed: TokenFeed | None, logits_rows: list[int],
                      num_tokens: int, layer_ready: list[torch.cuda.Event] | None = None) -> torch.Tensor:
        """The logits of `logits_rows`, in order: the verify graph of the smallest bucket that
        holds the step (every row it asks for is one of its tokens), else (or with
        `layer_ready`: verify graphs are one segment) eagerly."""
        graphs = self.cuda_graphs
        bucket = graphs.token_bucket(graphs.verify, num_tokens, len(chunks))
        if bucket is not None and len(logits_rows) <= bucket and layer_ready is None:
            layout = self.inputs.stage_verify(chunks, logits_rows, bucket, graphs.graph_seqs(bucket, "verify"))
            self._feed_rows(layout, feed)
            return graphs.verify.replay(bucket)[: len(logits_rows)]
        layout = self.inputs.stage(chunks, logits_rows)
        self._feed_rows(layout, feed)
        return self._forward(layout, layout.logits_rows, layer_ready)

    def _feed_rows(self, layout: StepLayout, feed: TokenFeed | None) -> None:
        if feed is not None:
            self._feed(layout.input_ids, feed, layout.last_rows)

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

    def _forward(self, layout: StepLayout, logits_rows: torch.Tensor | None = None,
                 layer_ready: list[torch.cuda.Event] | None = None) -> torch.Tensor:
        """Eagerly: logits of `logits_rows` (a device index), or of each sequence's last row."""
        metadata = self.backend.metadata_for(layout)
        hidden = self.model(layout.input_ids, layout.positions, self.kv_cache, self.backend, metadata, layer_ready)
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

    def capture_graphs(self, max_batch_size: int, verify: bool = False) -> None:
        """Capture `cuda_graphs` over this runner's pool: decode batches up to `max_batch_size`,
        the prefill steps and their cascade twins, with `verify` the verify steps."""
        assert self.kv_cache is not None, "allocate the KV cache first"
        self.cuda_graphs.capture(self.kv_cache, max_batch_size, verify)

    @torch.inference_mode()
    def warm_up(self, num_tokens: int = 513) -> None:
        """Compile the eager path's kernel variants before the first request: one eager step of
        `num_tokens` (odd, past every prefill graph) over the pool's first blocks, which no
        request holds yet (their slots get finite values that every later context overwrites
        before reading), then cascade steps (`_warm_up_cascade`).

        Triton compiles a kernel per specialisation: its constexprs, and its integer arguments'
        divisibility by 16. A variant first met by a request compiles inside that request's step
        (~1 s): the profiling step (8,192 tokens) compiled one side only, and cascade attention
        runs only when a step's sequences share a long prefix, its suffix pass in two tile sizes
        (by the step's longest query). These steps meet the rest first (the CUDA graphs, cascade
        twins included, compile theirs in the run before each capture)."""
        assert self.kv_cache is not None, "allocate the KV cache first"
        num_tokens = min(num_tokens, self.inputs.capacity[0])
        num_blocks = math.ceil(num_tokens / self.block_size)
        if num_blocks > min(self.kv_cache.shape[0], self.max_blocks_per_seq):
            return
        self._forward(self.inputs.stage([ChunkInput([0] * num_tokens, 0, list(range(num_blocks)))]))
        self._warm_up_cascade()

    def _warm_up_cascade(self) -> None:
        """Cascade attention's kernels (worker/attention/triton_paged.py): two sequences on
        CASCADE_MIN_TOKENS shared tokens of the pool's first blocks (zeros, or what the step
        before wrote: finite), each writing its new tokens into blocks of its own after them: one
        token each (the suffix pass's short tiles), then the second `short_query_tokens + 1`
        (its long ones). Skipped where the pool, a block table or a step (one sequence at most:
        then no step ever shares a prefix) cannot hold that."""
        prefix_blocks = -(-CASCADE_MIN_TOKENS // self.block_size)
        prefix = list(range(prefix_blocks))
        start = prefix_blocks * self.block_size
        for query_len in (1, self.short_query_tokens + 1):
            own_blocks = -(-query_len // self.block_size)
            if (prefix_blocks + 1 + own_blocks > self.kv_cache.shape[0] or self.max_num_seqs < 2
                    or prefix_blocks + own_blocks > self.max_blocks_per_seq):
                return
            own = list(range(prefix_blocks + 1, prefix_blocks + 1 + own_blocks))
            self._forward(self.inputs.stage([ChunkInput([0], start, [*prefix, prefix_blocks]),
                                             ChunkInput([0] * query_len, start, [*prefix, *own])]))
