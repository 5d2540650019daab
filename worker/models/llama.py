"""The Llama-shaped decoders: Llama 2/3, SmolLM2, Mistral, Qwen2/2.5, Qwen3, the
mixtures of experts Qwen3-MoE and Mixtral, and DeepSeek V2/V3 (latent attention, experts).

One implementation; the families differ only in flags read from the config:

    family     q/k/v bias      q/k RMSNorm  feed-forward     notes
    llama      attention_bias  -            MLP              Llama 3.1 "llama3" rope scaling
    mistral    -               -            MLP              sliding window: the runner refuses
                                                               longer contexts
    qwen2      always          -            MLP
    qwen3      attention_bias  per head     MLP              head_dim from the config
    qwen3_moe  attention_bias  per head     experts, or MLP  softmax top-k, renormalised if
                                              in mlp_only_layers  norm_topk_prob
    mixtral    -               -            experts          softmax top-k, renormalised;
                                                               sliding window as mistral
    deepseek_  MLA (mla.py):   -            MLP in the first grouped top-k with shared experts;
    v2, v3     attention_bias               first_k_dense_     a latent KV cache (one side)
                                            replace, then
                                            experts

Any family may scale its rotary wavelengths, "llama3" or "yarn" (rope_scaling.py).

Parameters carry Hugging Face's names, except that q/k/v and gate/up are fused
(`qkv_proj`, `gate_up_proj`) and the experts stacked (sparse_moe.py); `load_weights` maps the
checkpoint's names onto them (checkpoint_names.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence

import torch
from torch import nn

from spillway.worker.attention.torch_paged import AttentionBackend, AttentionMetadata
from spillway.worker.models.checkpoint_names import EXPERT_NAMES, QWEN_EXPERTS, CheckpointNames, checkpoint_names
from spillway.worker.models.layers import (
    TORCH_OPS,
    DecoderOps,
    RMSNorm,
    RotaryEmbedding,
    ops_for,
)
from spillway.worker.models.mla import MlaAttention
from spillway.worker.models.mlp import MLP
from spillway.worker.models.sparse_moe import SparseMoeBlock
from spillway.worker.models.spec import MLA_MODEL_TYPES, DecoderSpec, model_type_of


class Attention(nn.Module):
    def __init__(self, spec: DecoderSpec, layer_idx: int, ops: DecoderOps) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.ops = ops
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.q_size = spec.num_heads * spec.head_dim
        self.kv_size = spec.num_kv_heads * spec.head_dim
        self.qkv_proj = nn.Linear(spec.hidden_size, self.q_size + 2 * self.kv_size, bias=spec.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, spec.hidden_size, bias=spec.o_bias)
        self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps, ops) if spec.qk_norm else None
        self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps, ops) if spec.qk_norm else None

    def forward(self, hidden, rope, kv_cache, backend: AttentionBackend, metadata: AttentionMetadata):
        qkv = self.qkv_proj(hidden)
        if self.ops.prepare_qkv is not None:
            # One launch instead of up to four small ones (q norm, k norm, rotary, KV store).
            q = self.ops.prepare_qkv(qkv, rope, kv_cache, self.layer_idx, metadata.slot_mapping,
                                     self.num_heads, self.num_kv_heads, self.head_dim, self.q_norm, self.k_norm)
            out = backend.attend(self.layer_idx, q, kv_cache, metadata)
            return self.o_proj(out.reshape(-1, self.q_size))
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.ops.rotate_q_k(q, k, rope)
        out = backend.forward(self.layer_idx, q, k, v, kv_cache, metadata)
        return self.o_proj(out.reshape(-1, self.q_size))


class DecoderLayer(nn.Module):
    """One block over the residual stream, which travels beside the hidden states so that
    the residual add and the next norm are one operation (one kernel on CUDA)."""

    def __init__(self, spec: DecoderSpec, layer_idx: int, ops: DecoderOps) -> None:
        super().__init__()
        self.self_attn = MlaAttention(spec, layer_idx, ops) if spec.mla is not None else Attention(spec, layer_idx, ops)
        if spec.moe is not None and spec.moe.is_sparse(layer_idx):
            self.mlp = SparseMoeBlock(spec.hidden_size, spec.moe, ops)
        else:
            self.mlp = MLP(spec.hidden_size, spec.intermediate_size, spec.mlp_bias, ops)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, ops)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, ops)

    def forward(self, hidden, residual, rope, kv_cache, backend, metadata):
        """`(mlp output, residual stream)`; `residual` None marks the first layer."""
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm.add_forward(hidden, residual)
        hidden = self.self_attn(hidden, rope, kv_cache, backend, metadata)
        hidden, residual = self.post_attention_layernorm.add_forward(hidden, residual)
        return self.mlp(hidden), residual


class DecoderModel(nn.Module):
    def __init__(self, spec: DecoderSpec, ops: DecoderOps) -> None:
        super().__init__()
        # Given its weight, the embedding skips its own normal_ init, which on the meta device
        # imports torch._dynamo: most of a second of every worker's start, for weights that
        # `build` gives storage to and the loader fills anyway.
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size,
                                         _weight=torch.empty(spec.vocab_size, spec.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(spec, i, ops) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, ops)


class LlamaForCausalLM(nn.Module):
    """A Llama-shaped decoder over the paged KV cache; see the module docstring for families."""

    def __init__(self, config, ops: DecoderOps = TORCH_OPS) -> None:
        super().__init__()
        self.spec = spec = DecoderSpec.from_config(config)
        self.ops = ops
        self.expert_names = EXPERT_NAMES.get(model_type_of(config), QWEN_EXPERTS)
        self.model = DecoderModel(spec, ops)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(spec.rotary_dim, spec.rope_theta, spec.rope_scaling)
        self.tie_weights()

    @classmethod
    def build(
        cls, config, *, device: torch.device, dtype: torch.dtype, ops: DecoderOps | None = None,
        reshape: Callable[[LlamaForCausalLM], object] | None = None,
    ) -> LlamaForCausalLM:
        """The model on `device` in `dtype`, its weights uninitialised (the loader fills them).

        Built on the meta device and then given storage, so no time goes into random init.
        `ops` defaults to the Triton kernels on CUDA and plain torch elsewhere. `reshape` runs
        on the meta model before it gets storage: tensor parallelism cuts it to one rank's shard
        there (worker/models/shard_loading.py), so the whole model never exists on the device.
        """
        device = torch.device(device)
        with torch.device("meta"):
            model = cls(config, ops or ops_for(device))
        if reshape is not None:
            reshape(model)
        _give_storage(model.to(dtype=dtype), device)
        model.rotary.to(device)
        return model.eval()

    @property
    def num_layers(self) -> int:
        return self.spec.num_layers

    @property
    def num_kv_heads(self) -> int:
        return self.spec.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.spec.head_dim

    @property
    def kv_sides(self) -> int:
        """Sides of the KV cache: keys and values (2), or one latent row (1, MLA)."""
        return self.spec.kv_sides

    @property
    def attention_scale(self) -> float | None:
        """The softmax scale the attention backend must use; None: its default, head_dim ** -0.5
        (an MLA model's is over its query-key head dim, not the latent row it attends over)."""
        return self.spec.mla.softmax_scale if self.spec.mla is not None else None

    @property
    def sliding_window(self) -> int | None:
        """Attention is full, so contexts are exact only up to the checkpoint's window."""
        return self.spec.sliding_window

    def tie_weights(self) -> None:
        """Share the embedding with lm_head when the config says so."""
        if self.spec.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        backend: AttentionBackend,
        metadata: AttentionMetadata,
        layer_ready: Sequence[torch.cuda.Event] | None = None,
    ) -> torch.Tensor:
        """Final hidden states `[rows, hidden_size]` for packed tokens `[rows]`. `layer_ready`:
        an event per layer that the current stream waits for before that layer (its KV is
        still landing: worker/kv_tier/copier.py)."""
        hidden = self.model.embed_tokens(input_ids)
        rope = self.ops.rope_for_step(self.rotary, positions, hidden.dtype)
        residual = None
        for index, layer in enumerate(self.model.layers):
            if layer_ready is not None:
                layer_ready[index].wait()
            hidden, residual = layer(hidden, residual, rope, kv_cache, backend, metadata)
        hidden, _ = self.model.norm.add_forward(hidden, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """float32 logits of `hidden`'s rows, in `out` when given (a float32 `[rows, vocab]`)."""
        if out is None:
            return self.lm_head(hidden).float()
        return out.copy_(self.lm_head(hidden))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy a Hugging Face state dict (or safetensors stream) into the parameters. On a
        tensor-parallel shard, the stream holds the rank's slices (shard_loading.py).

        Raises ValueError naming every missing and unexpected weight, or a shape mismatch.
        """
        names = self._checkpoint_names()
        optional = {"lm_head.weight"} if self.spec.tie_word_embeddings else set()
        loaded: set[str] = set()
        unexpected: list[str] = []
        with torch.no_grad():
            for name, tensor in weights:
                if name.endswith("rotary_emb.inv_freq") or self._is_unserved_layer(name):
                    continue
                if name in names.targets:
                    target, covered = names.targets[name], (name,)
                elif name in names.aliases:
                    target, covered = names.aliases[name]
                else:
                    unexpected.append(name)
                    continue
                destination = target.view()
                if destination.shape != tensor.shape:
                    raise ValueError(
                        f"weight {name} has shape {tuple(tensor.shape)}, expected {tuple(destination.shape)}"
                    )
                destination.copy_(tensor)
                loaded.update(covered)
        missing = sorted(set(names.targets) - loaded - optional)
        if missing or unexpected:
            raise ValueError(
                f"checkpoint does not match the model: missing {missing}, unexpected {sorted(unexpected)}"
            )

    def checkpoint_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """`(Hugging Face name, view of our parameter)` for every checkpoint weight, each expert's
        apart as checkpoints hold them: the inverse of `load_weights`, for handing the same
        weights to a reference model or writing them out."""
        for name, target in self._checkpoint_names().targets.items():
            yield name, target.view()

    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        """The shape of every tensor a checkpoint may hold, by name: `checkpoint_weights`'
        and those of transformers' stacked expert tensors."""
        names = self._checkpoint_names()
        targets = {name: tuple(target.view().shape) for name, target in names.targets.items()}
        return targets | {name: tuple(target.view().shape) for name, (target, _) in names.aliases.items()}

    def _is_unserved_layer(self, name: str) -> bool:
        """DeepSeek V3 checkpoints hold their multi-token-prediction layer after the decoder's
        (`model.layers.61`), which is not served, as transformers skips it."""
        if self.spec.mla is None or not name.startswith("model.layers."):
            return False
        layer = name.split(".", 3)[2]
        return layer.isdigit() and int(layer) >= self.spec.num_layers

    def _checkpoint_names(self) -> CheckpointNames:
        qkv_rows = [self.spec.num_heads * self.head_dim] + [self.num_kv_heads * self.head_dim] * 2
        return checkpoint_names(self, qkv_rows, self.expert_names)


def _give_storage(model: nn.Module, device: torch.device) -> None:
    """Replace each meta parameter with uninitialised storage on `device`, one per distinct
    parameter, so that tied weights stay one tensor (`to_empty` would give each its own).
    By shape and dtype: `empty_like` from the meta device imports torch's symbolic shapes, half
    a second of every worker's start."""
    storage: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if id(param) not in storage:
                storage[id(param)] = nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device=device),
                                                  requires_grad=param.requires_grad)
            setattr(module, name, storage[id(param)])
