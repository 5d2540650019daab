"""DeepSeek's multi-head latent attention (MLA), in absorbed form over a latent KV cache.

Each token's keys and values come from one latent row, and only that row is cached (one side,
one head of `kv_lora_rank + qk_rope_head_dim` values: 512 + 64 in the released models):

    hidden ─ kv_a_proj_with_mqa ─┬─ c_kv  [512] ─ kv_a_layernorm ─┐
                                 └─ k_pe  [64]  ─ rotary ─────────┴─► cached row [576]

transformers up-projects the row through `kv_b_proj` into every head's key (`k_nope | k_pe`)
and value. Here `kv_b_proj`'s two halves are absorbed instead, per head h:

    q_h . k_h  = (q_nope_h @ W_UK_h) . c_kv + q_pe_h . k_pe     W_UK_h  [nope, 512]
    out_h      = W_UV_h @ (sum_s p_s c_kv_s)                     W_UV_h  [v, 512]

so attention runs as multi-query attention of every head's `[q_nope_h @ W_UK_h | q_pe_h]`
(576 values) against the one latent head, keys the cached rows and values their first 512
values (the backend reads both from the same rows: a one-sided cache), then W_UV_h per head,
then `o_proj`. Prefill runs the same form; it is exact up to float rounding.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from spillway.worker.attention.torch_paged import AttentionBackend, AttentionMetadata
from spillway.worker.models.layers import DecoderOps, RMSNorm
from spillway.worker.models.spec import DecoderSpec, MlaSpec, RopeLayout

# The latent norms' epsilon: DeepSeek's and transformers' default, not the config's rms_norm_eps.
LATENT_NORM_EPS = 1e-6


def rotate_mla(q_pe: torch.Tensor, k_pe: torch.Tensor, rope: tuple[torch.Tensor, ...], layout: RopeLayout,
               rotate_q_k: Callable) -> tuple[torch.Tensor, torch.Tensor]:
    """q_pe `[tokens, heads, rope_dim]` and k_pe `[tokens, 1, rope_dim]` rotated by `rope` (what
    the ops' `rope_for_step` made) through the ops' `rotate_q_k` (in place on a GPU). `PAIRS`
    turns dims (2i, 2i + 1) together and returns them de-interleaved (all first members, then all second members), as transformers' DeepSeek
    V3 does; DeepSeek V2's complex product gives the same values interleaved, and q.k is the
    same sum either way, so q and k only need the one layout."""
    if layout is RopeLayout.PAIRS:
        q_pe = torch.cat((q_pe[..., 0::2], q_pe[..., 1::2]), dim=-1)
        k_pe = torch.cat((k_pe[..., 0::2], k_pe[..., 1::2]), dim=-1)
    return rotate_q_k(q_pe, k_pe, rope)


class LatentUpProjection(nn.Module):
    """`kv_b_proj`: its weight `[heads * (nope + v), kv_lora_rank]` under the checkpoint's name,
    never applied as a linear layer. W_UK and W_UV are views of it. Not an `nn.Linear`, so the
    CPU's weight packing (worker/models/cpu_linear.py) leaves it readable."""

    def __init__(self, kv_lora_rank: int, num_heads: int, qk_nope_head_dim: int, v_head_dim: int) -> None:
        super().__init__()
        self.num_heads, self.split = num_heads, (qk_nope_head_dim, v_head_dim)
        self.weight = nn.Parameter(torch.empty(num_heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank))

    def halves(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`(W_UK [heads, nope, kv_lora_rank], W_UV [heads, v, kv_lora_rank])`, views."""
        return self.weight.view(self.num_heads, -1, self.weight.shape[1]).split(self.split, dim=1)


class MlaAttention(nn.Module):
    """A DeepSeek attention layer; parameters under transformers' names, so checkpoints load
    as they are."""

    def __init__(self, spec: DecoderSpec, layer_idx: int, ops: DecoderOps) -> None:
        super().__init__()
        mla = spec.mla
        assert mla is not None, "an MLA layer needs the config's latent attention"
        self.mla: MlaSpec = mla
        self.layer_idx = layer_idx
        self.num_heads = spec.num_heads
        hidden, heads = spec.hidden_size, spec.num_heads
        if mla.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, heads * mla.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, mla.q_lora_rank, bias=spec.qkv_bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, LATENT_NORM_EPS, ops)
            self.q_b_proj = nn.Linear(mla.q_lora_rank, heads * mla.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, mla.latent_dim, bias=spec.qkv_bias)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, LATENT_NORM_EPS, ops)
        self.ops = ops
        self.kv_b_proj = LatentUpProjection(mla.kv_lora_rank, heads, mla.qk_nope_head_dim, mla.v_head_dim)
        self.o_proj = nn.Linear(heads * mla.v_head_dim, hidden, bias=spec.o_bias)

    def forward(self, hidden: torch.Tensor, rope, kv_cache: torch.Tensor, backend: AttentionBackend,
                metadata: AttentionMetadata) -> torch.Tensor:
        mla, heads = self.mla, self.num_heads
        if mla.q_lora_rank is None:
            q = self.q_proj(hidden)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        q_nope, q_pe = q.view(-1, heads, mla.qk_head_dim).split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(hidden).split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
        q_pe, k_pe = rotate_mla(q_pe, k_pe[:, None, :], rope, mla.rope_layout, self.ops.rotate_q_k)
        w_uk, w_uv = self.kv_b_proj.halves()
        q_latent = torch.einsum("thd,hdc->thc", q_nope, w_uk)
        rows = torch.cat((self.kv_a_layernorm(latent)[:, None, :], k_pe), dim=-1)  # [tokens, 1, latent_dim]
        out = backend.forward(self.layer_idx, torch.cat((q_latent, q_pe), dim=-1), rows, None, kv_cache, metadata)
        attended = torch.einsum("thc,hvc->thv", out[..., : mla.kv_lora_rank], w_uv)
        return self.o_proj(attended.reshape(-1, heads * mla.v_head_dim))
