"""Tensor parallelism for the Llama-shaped decoders: cut a loaded model down to one rank's shard.

N ranks each hold a slice of every layer and run the same packed step. Per layer, two
all-reduces put the slices back together; the logits are gathered once:

    qkv_proj       column-parallel: rank r keeps the q/k/v rows of its heads
    gate_up_proj   column-parallel: rank r keeps its slice of the gate rows and of the up rows
    o_proj         row-parallel: the input columns of rank r's heads; the ranks' partial
    down_proj        outputs are summed (all_reduce) and the bias, kept by rank 0, added once
    embed_tokens   vocab-parallel: rank r looks up the ids of its vocabulary slice, zeros for
                     the others; all_reduce
    lm_head        vocab-parallel: rank r scores its slice; all_gather into the full logits

An MLA layer (mla.py, DeepSeek V2/V3) splits its query heads the same way: the rows of the
query projection and of kv_b_proj (W_UK, W_UV) for rank r's heads, o_proj row-parallel; its
latent row (kv_a_proj_with_mqa and its norm, q_a_proj) is every head's, so each rank computes
and caches the whole latent (its pool is the same on every rank).

A mixture-of-experts layer (sparse_moe.py) keeps every expert on every rank, each cut as the
MLP is: rank r holds its slice of each expert's width (gate_up_proj its gate rows and its up
rows, down_proj the matching columns), and so of the shared experts' width. The router is
replicated; the block's output, the experts' partial sums plus the shared experts', is summed
over the ranks once (`RowParallelMoe`).

Query heads split evenly. KV heads split evenly where N divides them; where they are fewer and
divide N, each is replicated to the N / num_kv_heads ranks whose query heads read it. The
vocabulary is padded with zero rows up to a multiple of N, and the padding cut from the logits.

The attention layers then see their rank's head counts, and so does `model.num_kv_heads`: a
rank's KV pool holds its heads only. `shard_model` cuts a checkpoint's model on the meta
device, before it has storage (shard_loading.py reads the slices into it), and a dummy model
after its weights are generated; either way before the CPU path packs the linear layers for
oneDNN (cpu_linear.py) or the GPU path re-lays them input-major (gpu_linear.py): both find the
shards, plain `nn.Linear`s, inside the wrappers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from spillway.worker.models.llama import Attention, LlamaForCausalLM
from spillway.worker.models.mla import MlaAttention
from spillway.worker.models.mlp import MLP
from spillway.worker.models.sparse_moe import SparseMoeBlock
from spillway.worker.models.spec import DecoderSpec, MoeSpec

# torch 2.13 renamed all_gather_into_tensor (deprecated there); torch 2.4 has only the old name.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True, slots=True)
class ShardLayout:
    """What rank `rank` of `world_size` holds: its query heads, KV heads (replicas included),
    intermediate slice, slices of each expert's and of the shared experts' width (0 for a
    dense model, or one without shared experts) and vocabulary rows (padded), each a
    contiguous range."""

    rank: int
    world_size: int
    num_heads: int
    num_kv_heads: int
    first_kv_head: int
    intermediate_size: int
    vocab_rows: int
    expert_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0

    @classmethod
    def plan(cls, spec: DecoderSpec, rank: int, world_size: int) -> ShardLayout:
        """The layout, or ValueError naming the sizes that do not split over `world_size` ranks."""
        assert 0 <= rank < world_size, f"rank {rank} outside a group of {world_size}"
        heads, kv_heads = spec.num_heads, spec.num_kv_heads  # an MLA model's: its one latent head
        if heads % world_size:
            raise ValueError(f"tensor parallel size {world_size} does not divide the model's {heads} attention heads")
        if (kv_heads % world_size if kv_heads >= world_size else world_size % kv_heads):
            raise ValueError(
                f"tensor parallel size {world_size} and the model's {kv_heads} KV heads do not divide one another "
                f"(the KV heads are split across the ranks, or replicated when fewer)"
            )
        if spec.intermediate_size % world_size:
            raise ValueError(f"tensor parallel size {world_size} does not divide the model's intermediate size "
                             f"{spec.intermediate_size}")
        expert_size, shared_size = _expert_widths(spec.moe)
        for what, size in (("experts' intermediate size", expert_size), ("shared experts' intermediate size",
                                                                         shared_size)):
            if size % world_size:
                raise ValueError(f"tensor parallel size {world_size} does not divide the model's {what} {size}")
        return cls(
            rank=rank,
            world_size=world_size,
            num_heads=heads // world_size,
            num_kv_heads=max(kv_heads // world_size, 1),
            # Split: rank r's heads start at r * K / N. Replicated (K < N): the head its query heads read.
            first_kv_head=rank * kv_heads // world_size,
            intermediate_size=spec.intermediate_size // world_size,
            vocab_rows=-(-spec.vocab_size // world_size),
            expert_intermediate_size=expert_size // world_size,
            shared_expert_intermediate_size=shared_size // world_size,
        )

    @property
    def first_head(self) -> int:
        return self.rank * self.num_heads

    @property
    def first_vocab_row(self) -> int:
        return self.rank * self.vocab_rows


def shard_model(model: LlamaForCausalLM, rank: int, world_size: int,
                group: dist.ProcessGroup | None = None) -> ShardLayout:
    """Cut `model` (loaded, or on the meta device) in place down to rank `rank`'s shard; returns its layout.

    Every rank of `group` (the default group when None) must shard the same model and then
    run the same steps: the forward pass calls collectives. `model.spec` then holds the rank's
    head counts and intermediate size; its `vocab_size` stays the full one, the logits' width.
    Raises ValueError (before touching the model) where the sizes do not split.
    """
    layout = ShardLayout.plan(model.spec, rank, world_size)
    with torch.no_grad():
        for layer in model.model.layers:
            if isinstance(layer.self_attn, MlaAttention):
                _shard_mla(layer.self_attn, layout, group)
            else:
                _shard_attention(layer.self_attn, layout, group)
            if isinstance(layer.mlp, SparseMoeBlock):
                layer.mlp = _shard_moe(layer.mlp, layout, group)
            else:
                _shard_mlp(layer.mlp, layout, group)
        embedding = VocabParallelEmbedding(model.model.embed_tokens.weight, layout, group)
        lm_head = model.lm_head
        if model.spec.tie_word_embeddings:
            lm_head.weight = embedding.weight
        else:
            lm_head.weight = nn.Parameter(_vocab_slice(lm_head.weight, layout), requires_grad=False)
        lm_head.out_features = layout.vocab_rows
        model.model.embed_tokens = embedding
        model.lm_head = ParallelLMHead(lm_head, model.spec.vocab_size, layout, group)
    moe = model.spec.moe
    if moe is not None:
        moe = dataclasses.replace(moe, expert_intermediate_size=layout.expert_intermediate_size,
                                  shared_expert_intermediate_size=layout.shared_expert_intermediate_size or None)
    model.spec = dataclasses.replace(model.spec, num_heads=layout.num_heads, num_kv_heads=layout.num_kv_heads,
                                     intermediate_size=layout.intermediate_size, moe=moe)
    return layout


class RowParallelLinear(nn.Module):
    """A row-parallel projection: this rank's input columns (`linear`, its bias only on rank 0)
    and the sum of every rank's partial output."""

    def __init__(self, linear: nn.Linear, group: dist.ProcessGroup | None) -> None:
        super().__init__()
        self.linear = linear
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.linear(x)
        dist.all_reduce(out, group=self.group)
        return out


class RowParallelMoe(nn.Module):
    """A mixture-of-experts block (`moe`) holding this rank's slice of every expert's width, and
    the sum of every rank's partial output."""

    def __init__(self, moe: SparseMoeBlock, group: dist.ProcessGroup | None) -> None:
        super().__init__()
        self.moe = moe
        self.group = group

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self.moe(hidden)
        dist.all_reduce(out, group=self.group)
        return out


class VocabParallelEmbedding(nn.Module):
    """This rank's rows of the embedding table; the other ranks supply the other ids' rows."""

    def __init__(self, full_weight: torch.Tensor, layout: ShardLayout, group: dist.ProcessGroup | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(_vocab_slice(full_weight, layout), requires_grad=False)
        self.first_row = layout.first_vocab_row
        self.group = group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local_ids = input_ids - self.first_row
        elsewhere = (local_ids < 0) | (local_ids >= self.weight.shape[0])
        hidden = F.embedding(local_ids.masked_fill(elsewhere, 0), self.weight)
        hidden.masked_fill_(elsewhere[:, None], 0)
        dist.all_reduce(hidden, group=self.group)
        return hidden


class ParallelLMHead(nn.Module):
    """Scores this rank's vocabulary rows (`linear`) and gathers every rank's into full logits."""

    def __init__(self, linear: nn.Linear, vocab_size: int, layout: ShardLayout,
                 group: dist.ProcessGroup | None) -> None:
        super().__init__()
        self.linear = linear
        self.vocab_size = vocab_size
        self.world_size = layout.world_size
        self.group = group

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        local = self.linear(hidden).contiguous()
        rows, vocab_rows = local.shape
        gathered = local.new_empty(self.world_size * rows, vocab_rows)  # the ranks' outputs one after another
        _all_gather_single(gathered, local, group=self.group)
        # [rank, rows, slice] → [rows, rank * slice], less the padding rows past the vocabulary.
        by_rank = gathered.view(self.world_size, rows, vocab_rows)
        return by_rank.permute(1, 0, 2).reshape(rows, -1)[:, : self.vocab_size]


def _shard_attention(attn: Attention, layout: ShardLayout, group: dist.ProcessGroup | None) -> None:
    head_dim = attn.head_dim
    q_rows = _range(layout.first_head * head_dim, layout.num_heads * head_dim)
    kv_rows = _range(layout.first_kv_head * head_dim, layout.num_kv_heads * head_dim)
    k_start, v_start = attn.q_size, attn.q_size + attn.kv_size  # the full model's fused layout
    _keep_output_rows(attn.qkv_proj, [q_rows, _shift(kv_rows, k_start), _shift(kv_rows, v_start)])
    attn.o_proj = _row_parallel(attn.o_proj, q_rows, layout, group)
    attn.num_heads, attn.num_kv_heads = layout.num_heads, layout.num_kv_heads
    attn.q_size, attn.kv_size = layout.num_heads * head_dim, layout.num_kv_heads * head_dim


def _shard_mla(attn: MlaAttention, layout: ShardLayout, group: dist.ProcessGroup | None) -> None:
    """Rank r keeps its query heads: their rows of the query projection (q_proj, or q_b_proj
    after the replicated q_a_proj), of kv_b_proj (W_UK, W_UV), and their input columns of
    o_proj. The latent row (kv_a_proj_with_mqa, its norm) is every head's, so every rank
    computes and caches it whole."""
    mla = attn.mla
    query = attn.q_proj if mla.q_lora_rank is None else attn.q_b_proj
    _keep_output_rows(query, [_range(layout.first_head * mla.qk_head_dim, layout.num_heads * mla.qk_head_dim)])
    up = attn.kv_b_proj
    per_head = mla.qk_nope_head_dim + mla.v_head_dim
    rows = _range(layout.first_head * per_head, layout.num_heads * per_head)
    up.weight = nn.Parameter(up.weight[rows.start : rows.stop].contiguous(), requires_grad=False)
    up.num_heads = layout.num_heads
    attn.o_proj = _row_parallel(attn.o_proj, _range(layout.first_head * mla.v_head_dim,
                                                    layout.num_heads * mla.v_head_dim), layout, group)
    attn.num_heads = layout.num_heads


def _shard_mlp(mlp: MLP, layout: ShardLayout, group: dist.ProcessGroup | None) -> None:
    size = layout.intermediate_size
    rows = _range(layout.rank * size, size)
    full_size = mlp.gate_up_proj.out_features // 2
    _keep_output_rows(mlp.gate_up_proj, [rows, _shift(rows, full_size)])  # stays [gate | up]
    mlp.down_proj = _row_parallel(mlp.down_proj, rows, layout, group)


def _shard_moe(block: SparseMoeBlock, layout: ShardLayout, group: dist.ProcessGroup | None) -> RowParallelMoe:
    experts, size = block.experts, layout.expert_intermediate_size
    rows = _range(layout.rank * size, size)
    full_size = experts.down_proj.shape[2]
    kept_rows = torch.cat([experts.gate_up_proj[:, rows.start : rows.stop],  # stays [gate | up] per expert
                           experts.gate_up_proj[:, full_size + rows.start : full_size + rows.stop]], dim=1)
    experts.gate_up_proj = nn.Parameter(kept_rows, requires_grad=False)
    experts.down_proj = nn.Parameter(experts.down_proj[:, :, rows.start : rows.stop].contiguous(), requires_grad=False)
    if block.shared_experts is not None:
        shared = block.shared_experts
        shared_rows = _range(layout.rank * layout.shared_expert_intermediate_size, layout.shared_expert_intermediate_size)
        _keep_output_rows(shared.gate_up_proj, [shared_rows, _shift(shared_rows, shared.gate_up_proj.out_features // 2)])
        shared.down_proj.weight = nn.Parameter(shared.down_proj.weight[:, shared_rows.start : shared_rows.stop]
                                               .contiguous(), requires_grad=False)
        shared.down_proj.in_features = len(shared_rows)  # summed with the experts', in RowParallelMoe
    return RowParallelMoe(block, group)


def _expert_widths(moe: MoeSpec | None) -> tuple[int, int]:
    """(each expert's intermediate size, the shared experts'), 0 where there are none."""
    if moe is None:
        return 0, 0
    return moe.expert_intermediate_size, moe.shared_expert_intermediate_size or 0


def _row_parallel(linear: nn.Linear, columns: range, layout: ShardLayout,
                  group: dist.ProcessGroup | None) -> RowParallelLinear:
    linear.weight = nn.Parameter(linear.weight[:, columns.start : columns.stop].contiguous(), requires_grad=False)
    linear.in_features = len(columns)
    if layout.rank != 0:
        linear.bias = None  # added once, by rank 0, before the sum
    return RowParallelLinear(linear, group)


def _keep_output_rows(linear: nn.Linear, ranges: list[range]) -> None:
    """Keep these output rows of `linear` (weight and bias), in order."""
    def cut(tensor: torch.Tensor) -> nn.Parameter:
        return nn.Parameter(torch.cat([tensor[r.start : r.stop] for r in ranges]), requires_grad=False)

    linear.weight = cut(linear.weight)
    if linear.bias is not None:
        linear.bias = cut(linear.bias)
    linear.out_features = linear.weight.shape[0]


def _vocab_slice(weight: torch.Tensor, layout: ShardLayout) -> torch.Tensor:
    """This rank's `vocab_rows` rows of a `[vocab, hidden]` table, zero rows past the vocabulary."""
    start = min(layout.first_vocab_row, weight.shape[0])
    rows = weight[start : start + layout.vocab_rows]
    shard = weight.new_zeros(layout.vocab_rows, weight.shape[1])
    shard[: rows.shape[0]] = rows
    return shard


def _range(start: int, length: int) -> range:
    return range(start, start + length)


def _shift(rows: range, offset: int) -> range:
    return range(rows.start + offset, rows.stop + offset)
