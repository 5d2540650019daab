"""The CUDA graphs side of `ModelRunner` (worker/runner/model_runner.py): which captured graphs a step
replays, and their capture at start-up (worker/runner/cuda_graphs.py, worker/kv_tier/step_graphs.py).

`ModelRunner` inherits these from `RunnerGraphs`; they read its model, inputs, pool and the
graph sets it holds (`graphs`, `prefill_graphs`, `cascade_graphs`, `short_cascade_graphs`,
`verify_graphs`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from spillway.worker.attention.shared_prefix import may_share_a_prefix

if TYPE_CHECKING:
    from spillway.worker.runner.model_runner import ChunkInput


class RunnerGraphs:
    """The graph methods of `ModelRunner` (module doc)."""

    def _prefill_graphs_for(self, chunks: list[ChunkInput], bucket: int, shared_prefix_len: int):
        """The graphs whose `bucket` a staged prefill step replays: without a shared prefix the
        prefill graphs; with one the cascade twins, or their short twins where the bucket has
        one and no query is longer than `short_query_tokens` (worker/runner/cuda_graphs.py)."""
        if not shared_prefix_len or self.cascade_graphs is None:
            return self.prefill_graphs
        short = self.short_cascade_graphs
        if (short is not None and bucket in short.buckets
                and max(len(chunk.token_ids) for chunk in chunks) <= self.short_query_tokens):
            return short
        return self.cascade_graphs

    def _token_bucket(self, graphs, num_tokens: int, num_seqs: int) -> int | None:
        """The smallest bucket of the prefill or verify `graphs` that holds the step, or None."""
        if graphs is None or num_tokens > graphs.max_bucket:
            return None
        for bucket in graphs.buckets[graphs.buckets.index(graphs.bucket_for(num_tokens)):]:
            if num_seqs <= self._graph_seqs(bucket, graphs.kind):
                return bucket
        return None

    def _graph_seqs(self, bucket: int, kind: str) -> int:
        from spillway.worker.runner.cuda_graphs import prefill_graph_seqs

        return prefill_graph_seqs(bucket, self.max_num_seqs, kind)

    def capture_graphs(self, max_batch_size: int, verify: bool = False) -> None:
        """Capture the decode step for every batch-size bucket up to `max_batch_size`, then the
        prefill step (and its cascade twins) for every token bucket the step budget allows, then
        with `verify` the verify step for every verify bucket, into one memory pool."""
        from spillway.worker.runner.cuda_graphs import capture_step_graphs

        assert self.kv_cache is not None, "allocate the KV cache first"
        buckets = self.graph_buckets(max_batch_size, verify)
        self.logits_rows(buckets.logits_rows)  # at its full size before any graph holds a view of it
        (self.graphs, self.prefill_graphs, self.cascade_graphs, self.short_cascade_graphs,
         self.verify_graphs) = capture_step_graphs(self, buckets)

    def graph_buckets(self, max_batch_size: int, verify: bool):
        """The `GraphBuckets` that `capture_graphs(max_batch_size, verify)` captures."""
        from spillway.worker.runner.cuda_graphs import GraphBuckets

        cascade = may_share_a_prefix(self.max_num_seqs, self.max_blocks_per_seq * self.block_size)
        return GraphBuckets.plan(min(max_batch_size, self.max_num_seqs), self.max_num_seqs, self.inputs.capacity[0],
                                 verify=verify, cascade=cascade, short_query_tokens=self.short_query_tokens)

    def logits_rows(self, rows: int) -> torch.Tensor:
        """The first `rows` rows of the graphs' shared float32 logits buffer.

        Every graph writes its logits there: a buffer per graph, kept alive by its graph, would
        hold sum(buckets) rows (10 GB for Qwen3-8B's vocabulary at max_num_seqs 512). One graph
        replays at a time, and its logits are consumed on the same stream before the next
        replay. `capture_graphs` allocates it at its full size first, so no graph holds an
        older, smaller one."""
        if self._graph_logits is None or self._graph_logits.shape[0] < rows:
            self._graph_logits = torch.empty(rows, self.model.spec.vocab_size, dtype=torch.float32,
                                             device=self.device)
        return self._graph_logits[:rows]

    def graph_logits_bytes(self, max_batch_size: int, verify: bool) -> int:
        """What `capture_graphs(max_batch_size, verify)` allocates for logits, beyond the
        activations' peak: the shared buffer of `GraphBuckets.logits_rows` rows."""
        return self.graph_buckets(max_batch_size, verify).logits_rows * self.model.spec.vocab_size * 4
