"""CUDA graphs of small steps: decode steps by batch size, prefill/mixed and verify steps by
token count.

A step launches a few hundred small kernels; replaying them as one graph removes the Python
and launch cost that would otherwise bound small steps (a decode step, a short prompt, the
few new tokens after a cached prefix).

Decode graphs, one per batch-size bucket: a batch of n one-token sequences runs the graph of
the smallest bucket >= n, its rows past n padded (token 0, slot -1, context length 0): the
KV write skips them and attention gives them zeros, so they never touch a real sequence, and
their logits are dropped.

    buckets 1, 2, 4, 8, 16, 24, ... below max_num_seqs, and max_num_seqs itself

Prefill graphs, one per token bucket up to 2,048 tokens: any step of at most T tokens in at
most `prefill_graph_seqs(T)` sequences (prefill chunks, extends after a cached prefix, mixed
with decodes) runs the graph of the smallest such T. Its rows past the step's tokens are
padded as above, its sequences past the step's have no new tokens and a context of 0: the
ragged attention kernel's grid is sized by T and the sequence count alone, and its programs
for padding exit at once (worker/attention/triton_paged.py). Padded rows produce unspecified values
that no real row reads (every op but attention is row-wise).

    buckets 16, 32, 64, 96, 128, then every 16 to 256, every 32 to 512, every 64 to 1,024
    and every 128 to 2,048, up to max_num_batched_tokens

Past ~128 rows an 8B model's matrix products are compute-bound on an H200, so a step pays for
its padding rows: the steps keep them under 1/8 of the bucket. A 200-token step (50 requests of
4 new tokens on a shared prefix) runs at 208 rows, not 256: Qwen3-8B's products took 5.78 ms
there against 6.43 ms (tools/bench/kernels/buckets.py, docs/performance.md). Below 128 the products
read the weights and padding is nearly free.

Cascade graphs, the prefill graphs' twins: the same buckets, layout and step, with cascade
attention (kernels/cascade_attention.py) in place of the prefill kernel. A step whose
sequences share a cached prefix (`StepLayout.shared_prefix_len` > 0, found on the host
tables as they are staged) replays its bucket's cascade graph, which reads that length from
the staged inputs and the prefix's keys once for all rows; any other step, the plain prefill
graph. Twins rather than one graph that skips its cascade pass on a prefix of 0: the cascade
suffix pass walks each sequence's own keys unsplit, where the prefill kernel splits a long
context over the multiprocessors, so the plain graph stays the better one without a shared
prefix. Captured only where steps can share such a prefix (worker/attention/shared_prefix.py).

Short cascade twins, with the cascade graphs: the cascade graph again, its suffix pass at 16
query rows a program instead of 64. A step on a shared prefix whose every query is at most
`short_query_tokens` long (4 tokens with 4 query heads a KV head: one 16-row program) replays
its bucket's short twin, any other the cascade twin. The graph's shapes cannot tell the two
apart (64 x 4 new tokens and 2 x 128 both fill 256 rows in 64 slots); the host knows each
step's longest query. On an H200 the convoy's suffix pass (50 x 4 new tokens on a 10k-token
prefix) took 8.8 us a layer at 16 rows against 20.6 at 64, but 2 x 128 new tokens after
3,000 own keys took 154 us a layer (both passes) against 130: 16-row programs re-read a long
query's own keys four times as often (docs/performance.md).

    the cascade buckets that a step of only short queries can take: those whose fewest
    tokens (one past the bucket below) fit their sequence slots at short_query_tokens each;
    up to 256 with 4 tokens and 64 slots, up to 32 with 4 tokens and 8 slots

Verify graphs, with speculative decoding only: a step that returns the logits of chosen rows
(`ModelRunner.execute(..., logits_rows=...)`: each verified chunk's 1 + d rows, prompt-logprob
rows) takes the prefill graphs' layout, buckets (up to 256 tokens) and metadata, and returns
the logits of the T rows that its staged `logits_rows` index names: the rows asked for, in
order, then row 0 as padding. Gathering inside the graph rather than computing every row's
logits and gathering after the replay: both run the language-model head over T rows (up to a
few hundred rows its cost is mostly reading the weights, an estimate, not a measurement), but
the index arrives in the step's one input copy and the result is a view of the buffer's first
rows, with no copy or launch after the replay. The bound of 256 keeps the logits buffer at
most max(max_num_seqs, 256) rows (`GraphBuckets.logits_rows`), and covers 32 requests of
1 + 7 rows.

    the prefill buckets up to 256, up to max_num_batched_tokens

All graphs are captured into one memory pool (decode, prefill, cascade, short cascade, then
verify; each kind largest first) and write their logits into one shared buffer, allocated at
its full size before the first capture: only one graph replays at a time, and its logits are
consumed (sampled) before the next replay.

A runner holds its graphs in a `CudaGraphs`: it captures them over the runner's pool at
start-up and says which one a staged step replays.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from spillway.worker.attention.shared_prefix import may_share_a_prefix
from spillway.worker.attention.step_inputs import StepInputs, StepLayout
from spillway.worker.attention.torch_paged import AttentionBackend
from spillway.worker.kv_tier.step_graphs import StepGraphs


# Past 512 tokens a step still pays ~20 ms of eager launches for an 8B model (36 layers), as much
# as the compute of a 1,000-token chunk: a turn's new 512 tokens beside a few decodes is one.
PREFILL_TOKEN_BUCKETS = (16, 32, 64, 96, 128, *range(144, 257, 16), *range(288, 513, 32),
                         *range(576, 1025, 64), *range(1152, 2049, 128))
MAX_PREFILL_GRAPH_SEQS = 64
# Verification runs at batches of at most 32 (worker/speculative/switch.py): its graphs hold no more.
MAX_VERIFY_GRAPH_SEQS = 32
MAX_VERIFY_GRAPH_TOKENS = 256


def decode_buckets(max_batch_size: int) -> list[int]:
    """1, 2, 4, then every multiple of 8 below `max_batch_size`, then `max_batch_size` itself.

    Steps of 8 keep the padding small where it costs: at large batches the matrix products
    are compute-bound, so a batch of 200 in a bucket of 256 would do 28% more work.
    """
    assert max_batch_size >= 1
    sizes = [1, 2, 4, *range(8, max_batch_size, 8)]
    return [size for size in sizes if size < max_batch_size] + [max_batch_size]


def prefill_buckets(max_num_tokens: int) -> list[int]:
    """The token buckets of prefill graphs for steps of at most `max_num_tokens` tokens."""
    return [size for size in PREFILL_TOKEN_BUCKETS if size <= max_num_tokens]


def prefill_graph_seqs(num_tokens: int, max_num_seqs: int, kind: str = "prefill") -> int:
    """Sequences a prefill (or verify) graph of `num_tokens` rows holds: every sequence has >= 1
    new token, and at most 64: a burst of requests on one shared prefix (a few new tokens each)
    then runs in a graph, not eagerly at ~20 ms of launches, while the attention grid's padding
    programs (one per sequence slot, exiting at once) stay a few microseconds a layer. A
    verify graph (`kind` "verify") holds at most 32."""
    return min(num_tokens, max_num_seqs, MAX_VERIFY_GRAPH_SEQS if kind == "verify" else MAX_PREFILL_GRAPH_SEQS)


def short_cascade_buckets(buckets: list[int], max_num_seqs: int, short_query_tokens: int) -> list[int]:
    """The token `buckets` that a step whose every query is at most `short_query_tokens` long can
    take: those where one token more than the bucket below fits the bucket's sequence slots at
    `short_query_tokens` each. A step takes a bucket only with more tokens than the bucket
    below: every bucket holds as many sequences as tokens, or as many as every larger one."""
    return [size for below, size in zip([0, *buckets], buckets)
            if below < short_query_tokens * prefill_graph_seqs(size, max_num_seqs)]


@dataclass(frozen=True, slots=True)
class GraphBuckets:
    """The buckets a runner captures, and so the rows of the logits buffer its graphs share."""

    decode: list[int]
    prefill: list[int]
    verify: list[int]  # empty without speculative decoding
    max_num_seqs: int
    cascade: list[int]  # the prefill buckets, or empty where no step shares a prefix
    short_cascade: list[int]  # the first cascade buckets (`short_cascade_buckets`), or empty

    @classmethod
    def plan(cls, max_batch_size: int, max_num_seqs: int, max_num_tokens: int, *, verify: bool,
             cascade: bool = False, short_query_tokens: int = 0) -> GraphBuckets:
        """Decode buckets up to `max_batch_size`, token buckets up to `max_num_tokens`, with
        `verify` the verify buckets (token buckets up to `MAX_VERIFY_GRAPH_TOKENS`), and with
        `cascade` the token buckets again, for the cascade graphs, and those a step of queries
        of at most `short_query_tokens` tokens can take (0: none), for their short twins."""
        prefill = prefill_buckets(max_num_tokens)
        verify_buckets = [size for size in prefill if size <= MAX_VERIFY_GRAPH_TOKENS] if verify else []
        cascade_buckets = prefill if cascade else []
        return cls(decode_buckets(max_batch_size), prefill, verify_buckets, max_num_seqs, cascade_buckets,
                   short_cascade_buckets(cascade_buckets, max_num_seqs, short_query_tokens))

    @property
    def logits_rows(self) -> int:
        """The most rows one graph returns: a decode bucket's, a prefill graph's sequences, a
        verify bucket's."""
        seqs = [prefill_graph_seqs(size, self.max_num_seqs) for size in self.prefill]
        return max(self.decode[-1], *seqs, *self.verify)


class CudaGraphs:
    """A runner's captured steps (module doc): `decode` by batch size, `prefill` by token count
    and its `cascade` and `short_cascade` twins, `verify` with speculative decoding; each None
    until `capture`, and for a kind without buckets. Every step runs `model` over the pool
    through `backend`, on the fixed views of `inputs` that the runner stages a step into, and
    writes its logits into one buffer (`logits_rows`).

    `max_prefix_len`: the longest context a block table reaches. `short_query_tokens`: the
    longest query that a step replaying a short cascade twin may have.
    """

    def __init__(self, model: nn.Module, inputs: StepInputs, backend: AttentionBackend, *, device: torch.device,
                 max_num_seqs: int, max_prefix_len: int, short_query_tokens: int) -> None:
        self.model, self.inputs, self.backend, self.device = model, inputs, backend, device
        self.max_num_seqs = max_num_seqs
        self.max_prefix_len = max_prefix_len
        self.short_query_tokens = short_query_tokens
        self.decode: StepGraphs | None = None
        self.prefill: StepGraphs | None = None
        self.cascade: StepGraphs | None = None  # only where steps may share a prefix
        self.short_cascade: StepGraphs | None = None  # the first cascade buckets
        self.verify: StepGraphs | None = None
        self._logits: torch.Tensor | None = None

    # ---- which graph a step replays ----------------------------------------------------------

    def graph_seqs(self, bucket: int, kind: str) -> int:
        """The sequences a prefill (or verify) graph of `bucket` tokens holds."""
        return prefill_graph_seqs(bucket, self.max_num_seqs, kind)

    def token_bucket(self, graphs: StepGraphs | None, num_tokens: int, num_seqs: int) -> int | None:
        """The smallest bucket of the prefill or verify `graphs` that holds the step, or None."""
        if graphs is None or num_tokens > graphs.max_bucket:
            return None
        for bucket in graphs.buckets[graphs.buckets.index(graphs.bucket_for(num_tokens)):]:
            if num_seqs <= self.graph_seqs(bucket, graphs.kind):
                return bucket
        return None

    def prefill_for(self, bucket: int, layout: StepLayout) -> StepGraphs:
        """The graphs whose `bucket` a prefill step staged as `layout` replays: without a shared
        prefix the prefill graphs; with one the cascade twins, or their short twins where the
        bucket has one and no query is longer than `short_query_tokens`."""
        if not layout.shared_prefix_len or self.cascade is None:
            return self.prefill
        short = self.short_cascade
        if short is not None and bucket in short.buckets and max(layout.query_lens) <= self.short_query_tokens:
            return short
        return self.cascade

    # ---- start-up on CUDA --------------------------------------------------------------------

    def buckets(self, max_batch_size: int, verify: bool) -> GraphBuckets:
        """The `GraphBuckets` that `capture(kv_cache, max_batch_size, verify)` captures."""
        cascade = may_share_a_prefix(self.max_num_seqs, self.max_prefix_len)
        return GraphBuckets.plan(min(max_batch_size, self.max_num_seqs), self.max_num_seqs, self.inputs.capacity[0],
                                 verify=verify, cascade=cascade, short_query_tokens=self.short_query_tokens)

    def logits_bytes(self, max_batch_size: int, verify: bool) -> int:
        """What `capture(kv_cache, max_batch_size, verify)` allocates for logits, beyond the
        activations' peak: the shared buffer of `GraphBuckets.logits_rows` rows."""
        return self.buckets(max_batch_size, verify).logits_rows * self.model.spec.vocab_size * 4

    def logits_rows(self, rows: int) -> torch.Tensor:
        """The first `rows` rows of the graphs' shared float32 logits buffer.

        Every graph writes its logits there: a buffer per graph, kept alive by its graph, would
        hold sum(buckets) rows (10 GB for Qwen3-8B's vocabulary at max_num_seqs 512). One graph
        replays at a time, and its logits are consumed on the same stream before the next
        replay. `capture` allocates it at its full size first, so no graph holds an older,
        smaller one."""
        if self._logits is None or self._logits.shape[0] < rows:
            self._logits = torch.empty(rows, self.model.spec.vocab_size, dtype=torch.float32, device=self.device)
        return self._logits[:rows]

    def capture(self, kv_cache: torch.Tensor, max_batch_size: int, verify: bool = False) -> None:
        """Capture the decode step over `kv_cache` for every batch-size bucket up to
        `max_batch_size`, then the prefill step (and its cascade twins) for every token bucket
        the step budget allows, then with `verify` the verify step for every verify bucket,
        each kind largest first, into one memory pool."""
        buckets = self.buckets(max_batch_size, verify)
        self.logits_rows(buckets.logits_rows)  # at its full size before any graph holds a view of it
        pool = torch.cuda.graph_pool_handle()
        inputs = self.inputs
        decode = StepGraphs(buckets.decode, self.device)
        decode.capture(functools.partial(self.decode_step, kv_cache), inputs.pad_decode, pool)

        def token_graphs(kind: str, sizes: list[int], step, pad: Callable[[int, int], None]) -> StepGraphs | None:
            if not sizes:
                return None
            # The steps that compute on KV still landing are prefill steps: their graphs in segments.
            graphs = StepGraphs(sizes, self.device, kind=kind,
                                num_layers=None if kind == "verify" else self.model.num_layers)
            graphs.capture(functools.partial(step, kv_cache), lambda bucket: pad(bucket, self.graph_seqs(bucket, kind)),
                           pool)
            return graphs

        (self.decode, self.prefill, self.cascade, self.short_cascade, self.verify) = (
            decode, token_graphs("prefill", buckets.prefill, self.prefill_step, inputs.pad_prefill),
            token_graphs("cascade", buckets.cascade, self.cascade_step, inputs.pad_prefill),
            token_graphs("short_cascade", buckets.short_cascade, self.short_cascade_step, inputs.pad_prefill),
            token_graphs("verify", buckets.verify, self.verify_step, inputs.pad_verify))

    # ---- the steps a graph captures ----------------------------------------------------------

    def decode_step(self, kv_cache: torch.Tensor, bucket: int) -> Callable[[], torch.Tensor]:
        """A function running the decode step of `bucket` rows on the static input views."""
        from spillway.worker.attention.triton_paged import DecodeMetadata

        layout = self.inputs.decode_layout(bucket)
        metadata = DecodeMetadata(layout.block_tables, layout.context_lens, layout.slot_mapping)
        model, backend = self.model, self.backend
        logits = self.logits_rows(bucket)

        def step() -> torch.Tensor:
            hidden = model(layout.input_ids, layout.positions, kv_cache, backend, metadata)
            return model.compute_logits(hidden, out=logits)

        return step

    def prefill_step(self, kv_cache: torch.Tensor, bucket: int) -> Callable[[], torch.Tensor]:
        """A function running the prefill step of `bucket` tokens on the static input views:
        the logits of each sequence's last row."""
        layout = self.inputs.prefill_layout(bucket, self.graph_seqs(bucket, "prefill"))
        return self._token_step(kv_cache, layout, bucket, layout.last_rows)

    def cascade_step(self, kv_cache: torch.Tensor, bucket: int, short: bool = False) -> Callable[[], torch.Tensor]:
        """`prefill_step` with cascade attention over the prefix length staged with the inputs;
        its prefix splits are sized for `max_prefix_len`. `short`: its suffix pass at
        SHORT_SUFFIX_ROWS rows a program, for steps of short queries only."""
        layout = self.inputs.prefill_layout(bucket, self.graph_seqs(bucket, "prefill"))
        return self._token_step(kv_cache, layout, bucket, layout.last_rows, cascade=True, short=short)

    def short_cascade_step(self, kv_cache: torch.Tensor, bucket: int) -> Callable[[], torch.Tensor]:
        """`cascade_step` of a short twin."""
        return self.cascade_step(kv_cache, bucket, short=True)

    def verify_step(self, kv_cache: torch.Tensor, bucket: int) -> Callable[[], torch.Tensor]:
        """A function running the verify step of `bucket` tokens on the static input views: the
        logits of the `bucket` rows its `logits_rows` view names."""
        layout = self.inputs.verify_layout(bucket, self.graph_seqs(bucket, "verify"))
        return self._token_step(kv_cache, layout, bucket, layout.logits_rows)

    def _token_step(self, kv_cache: torch.Tensor, layout: StepLayout, bucket: int, rows: torch.Tensor,
                    cascade: bool = False, short: bool = False) -> Callable[[], torch.Tensor]:
        from spillway.kernels.cascade_attention import SHORT_SUFFIX_ROWS, SUFFIX_ROWS
        from spillway.worker.attention.triton_paged import graph_prefill_metadata

        model, backend = self.model, self.backend
        metadata = graph_prefill_metadata(layout.query_start_loc, layout.context_lens, layout.block_tables,
                                          layout.slot_mapping, bucket, num_heads=model.spec.num_heads,
                                          num_kv_heads=model.num_kv_heads, head_dim=model.head_dim,
                                          shared_prefix=layout.shared_prefix if cascade else None,
                                          max_prefix_len=self.max_prefix_len,
                                          cascade_suffix_rows=SHORT_SUFFIX_ROWS if short else SUFFIX_ROWS)
        logits = self.logits_rows(rows.shape[0])

        def step(layer_ready: Sequence | None = None) -> torch.Tensor:
            hidden = model(layout.input_ids, layout.positions, kv_cache, backend, metadata, layer_ready)
            return model.compute_logits(hidden[rows], out=logits)

        return step
