"""What a Llama-shaped decoder is, read from its Hugging Face config: the family (by
`model_type` or architecture), rotary parameters, and every size and flag the model is built
from (`DecoderSpec`), with its experts where it is a mixture of experts (`MoeSpec`) and its
latent attention where it is DeepSeek's (`MlaSpec`), and the geometry of the KV cache a config
needs (`kv_cache_row`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

from spillway.worker.models.rope_scaling import ROPE_TYPES, Llama3RopeScaling, RopeScaling, YarnRopeScaling
from spillway.worker.models.routers import GroupedTopK, GroupScore, Scoring

ARCHITECTURE_MODEL_TYPES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
}
MODEL_TYPES = tuple(ARCHITECTURE_MODEL_TYPES.values())
MLA_MODEL_TYPES = ("deepseek_v2", "deepseek_v3")


def model_type_of(config) -> str:
    """The family named by `config.model_type`, else by its first known architecture."""
    model_type = getattr(config, "model_type", "") or ""
    if model_type in MODEL_TYPES:
        return model_type
    for architecture in getattr(config, "architectures", None) or ():
        if architecture in ARCHITECTURE_MODEL_TYPES:
            return ARCHITECTURE_MODEL_TYPES[architecture]
    return model_type


def rope_scaling_parameters(config) -> dict:
    """The config's rope scaling entries (`rope_type`, `factor`, ...) from `rope_parameters`
    (transformers 5) or the older `rope_scaling`; `{}` where there is none."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    legacy = dict(getattr(config, "rope_scaling", None) or {})
    return params if rope_type_of(params) != "default" else legacy


def rope_type_of(scaling: dict) -> str:
    return scaling.get("rope_type", scaling.get("type", "default"))


def rope_from_config(config) -> tuple[float, RopeScaling | None]:
    """`(rope_theta, scaling)` from `rope_parameters` (transformers 5) or the older attributes."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    theta = params.get("rope_theta") or getattr(config, "rope_theta", None) or 10000.0
    scaling = rope_scaling_parameters(config)
    rope_type = rope_type_of(scaling)
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"unsupported rope type {rope_type!r}; supported: {', '.join(ROPE_TYPES)}")
    if rope_type == "default":
        return float(theta), None
    # The families here rotate the whole head; transformers computes a partial rotary
    # factor's shorter frequencies only for scaled types, then cannot apply them.
    partial_rotary_factor = scaling.get("partial_rotary_factor") or getattr(config, "partial_rotary_factor", None)
    if partial_rotary_factor not in (None, 1.0):
        raise ValueError(f"{rope_type} rope scaling with partial_rotary_factor={partial_rotary_factor} is not "
                         f"supported: these families rotate the whole head")
    max_positions = getattr(config, "max_position_embeddings", None)
    original = _original_max_positions(config, scaling, max_positions)
    if rope_type == "yarn":
        return float(theta), YarnRopeScaling.from_params(scaling, original, max_positions)
    return float(theta), Llama3RopeScaling(
        factor=float(scaling["factor"]),
        low_freq_factor=float(scaling["low_freq_factor"]),
        high_freq_factor=float(scaling["high_freq_factor"]),
        original_max_position_embeddings=original,
    )


def _original_max_positions(config, scaling: dict, max_positions: int | None) -> int:
    """The context a scaled rope was trained at: the config's own `original_max_position_embeddings`
    where it has one (transformers gives it priority, for Phi-3's configs), else the scaling's,
    else `max_position_embeddings`."""
    original = (getattr(config, "original_max_position_embeddings", None)
                or scaling.get("original_max_position_embeddings") or max_positions)
    if original is None:
        raise ValueError("rope scaling needs original_max_position_embeddings or max_position_embeddings")
    return int(original)


class RouterKind(str, Enum):
    """Which router chooses a sparse layer's experts (worker/models/routers.py)."""

    SOFTMAX_TOPK = "softmax_topk"
    GROUPED_TOPK = "grouped_topk"


@dataclass(frozen=True, slots=True)
class MoeSpec:
    """A mixture-of-experts decoder's experts: how many, how wide, which layers have them
    (the others have the dense MLP) and how tokens are routed to them.

    `weights_in_logits_dtype`: Qwen3-MoE rounds the routing weights to the model's dtype.
    `grouped_topk` holds the grouped router's parameters (`router` GROUPED_TOPK only);
    `correction_bias`: the router has DeepSeek V3's `e_score_correction_bias`, which it adds to
    the scores to choose the experts.
    `shared_expert_intermediate_size`: the width of a dense MLP every token also goes
    through, summed with the experts' output (DeepSeek's shared experts), None without one.
    """

    num_experts: int
    top_k: int
    expert_intermediate_size: int
    norm_topk_prob: bool
    sparse_layers: tuple[int, ...]
    router: RouterKind = RouterKind.SOFTMAX_TOPK
    weights_in_logits_dtype: bool = False
    grouped_topk: GroupedTopK | None = None
    correction_bias: bool = False
    shared_expert_intermediate_size: int | None = None

    def __post_init__(self) -> None:
        assert (self.router is RouterKind.GROUPED_TOPK) == (self.grouped_topk is not None), self.router
        assert self.grouped_topk is not None or not self.correction_bias, "only the grouped router takes a bias"
        assert 0 < self.top_k <= self.num_experts, (self.top_k, self.num_experts)

    def is_sparse(self, layer_idx: int) -> bool:
        return layer_idx in self.sparse_layers

    @classmethod
    def from_config(cls, config, model_type: str) -> MoeSpec | None:
        """The experts of a `qwen3_moe`, `mixtral` or DeepSeek config; None for the dense families
        (and a config without a sparse layer)."""
        if model_type in MLA_MODEL_TYPES:
            return _deepseek_moe(config, model_type)
        if model_type == "mixtral":
            return cls(num_experts=config.num_local_experts, top_k=config.num_experts_per_tok,
                       expert_intermediate_size=config.intermediate_size, norm_topk_prob=True,
                       sparse_layers=tuple(range(config.num_hidden_layers)))
        sparse_layers = _qwen3_moe_sparse_layers(config) if model_type == "qwen3_moe" else ()
        if sparse_layers:
            return cls(num_experts=config.num_experts, top_k=config.num_experts_per_tok,
                       expert_intermediate_size=config.moe_intermediate_size,
                       norm_topk_prob=bool(getattr(config, "norm_topk_prob", False)),
                       sparse_layers=sparse_layers, weights_in_logits_dtype=True)
        return None


def _deepseek_moe(config, model_type: str) -> MoeSpec | None:
    """DeepSeek's experts: every layer from `first_k_dense_replace` on, routed by the grouped
    router (V3: sigmoid scores with a correction bias, groups by their top-2 sum; V2: softmax
    scores, groups by their best, one group of all experts for "greedy"), plus shared experts."""
    first_sparse = getattr(config, "first_k_dense_replace", 0) or 0
    sparse_layers = tuple(range(first_sparse, config.num_hidden_layers))
    if not config.n_routed_experts or not sparse_layers:
        return None
    top_k = config.num_experts_per_tok
    renormalize = bool(getattr(config, "norm_topk_prob", False))
    if model_type == "deepseek_v3":
        router = GroupedTopK(Scoring.SIGMOID, GroupScore.TOP2_SUM, num_groups=config.n_group or 1,
                             topk_groups=config.topk_group or 1, renormalize=renormalize,
                             routed_scaling_factor=float(config.routed_scaling_factor))
    else:
        method = getattr(config, "topk_method", "greedy") or "greedy"
        if method not in ("greedy", "group_limited_greedy"):
            raise ValueError(f"unsupported DeepSeek V2 topk_method {method!r}; supported: greedy, group_limited_greedy")
        grouped = method == "group_limited_greedy"
        renormalize = renormalize and top_k > 1  # DeepSeek V2 scales only where it does not renormalise
        router = GroupedTopK(Scoring.SOFTMAX, GroupScore.MAX, num_groups=config.n_group if grouped else 1,
                             topk_groups=config.topk_group if grouped else 1, renormalize=renormalize,
                             routed_scaling_factor=1.0 if renormalize else float(config.routed_scaling_factor))
    shared = getattr(config, "n_shared_experts", 0) or 0
    return MoeSpec(num_experts=config.n_routed_experts, top_k=top_k,
                   expert_intermediate_size=config.moe_intermediate_size, norm_topk_prob=renormalize,
                   sparse_layers=sparse_layers, router=RouterKind.GROUPED_TOPK, grouped_topk=router,
                   correction_bias=model_type == "deepseek_v3",
                   shared_expert_intermediate_size=config.moe_intermediate_size * shared if shared else None)


def _qwen3_moe_sparse_layers(config) -> tuple[int, ...]:
    """As transformers decides: every `decoder_sparse_step`-th layer (counting from 1) that is
    not in `mlp_only_layers`, where the model has experts at all."""
    mlp_only = set(getattr(config, "mlp_only_layers", None) or ())
    step = getattr(config, "decoder_sparse_step", 1) or 1
    if not config.num_experts:
        return ()
    return tuple(i for i in range(config.num_hidden_layers) if i not in mlp_only and (i + 1) % step == 0)


class RopeLayout(str, Enum):
    """Which dims one rotary frequency turns: the two halves' i-th dims (Llama; DeepSeek V3
    without `rope_interleave`) or neighbouring pairs (DeepSeek V2; V3 with `rope_interleave`)."""

    HALVES = "halves"
    PAIRS = "pairs"


def mla_softmax_scale(qk_head_dim: int, scaling: dict) -> float:
    """`qk_head_dim ** -0.5`, times YaRN's `mscale` squared where the rope scaling has
    `mscale_all_dim` (DeepSeek scales every dim of q.k, not only the rotary ones), as
    transformers' `yarn_apply_mscale`."""
    scale = qk_head_dim**-0.5
    mscale_all_dim = scaling.get("mscale_all_dim", 0) if rope_type_of(scaling) != "default" else 0
    factor = float(scaling.get("factor", 1.0))
    if mscale_all_dim and factor > 1:
        mscale = 0.1 * mscale_all_dim * math.log(factor) + 1.0
        scale = scale * mscale * mscale
    return scale


@dataclass(frozen=True, slots=True)
class MlaSpec:
    """DeepSeek's multi-head latent attention (worker/models/mla.py). Each token's keys and
    values are up-projected from one latent row, which is all the KV cache keeps:

        latent_dim = kv_lora_rank (the normed latent c_kv) + qk_rope_head_dim (rotated k_pe)

    `q_lora_rank` None: the query is one projection (V2-Lite); else a low-rank pair with an
    RMSNorm between (`q_a_proj`, `q_a_layernorm`, `q_b_proj`). `softmax_scale` is over
    `qk_head_dim` (nope + rope dims), not over the latent row the attention reads.
    """

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_layout: RopeLayout
    softmax_scale: float

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @classmethod
    def from_config(cls, config, model_type: str) -> MlaSpec:
        """The latent attention of a DeepSeek V2/V3 config: rope type default, or YaRN as the
        released checkpoints have it (its frequencies and attention factor in the rotary
        embedding, its `mscale_all_dim` in the softmax scale)."""
        scaling = rope_scaling_parameters(config)
        rope_type = rope_type_of(scaling)
        if rope_type not in ("default", "yarn"):
            raise ValueError(f"unsupported rope type {rope_type!r} for an MLA model; supported: default, yarn")
        interleaved = model_type == "deepseek_v2" or bool(getattr(config, "rope_interleave", False))
        qk_head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
        return cls(q_lora_rank=config.q_lora_rank, kv_lora_rank=config.kv_lora_rank,
                   qk_nope_head_dim=config.qk_nope_head_dim, qk_rope_head_dim=config.qk_rope_head_dim,
                   v_head_dim=config.v_head_dim,
                   rope_layout=RopeLayout.PAIRS if interleaved else RopeLayout.HALVES,
                   softmax_scale=mla_softmax_scale(qk_head_dim, scaling))


def kv_cache_row(config) -> tuple[int, int, int]:
    """`(kv_sides, kv_heads, head_dim)` of one token's KV in one layer of `config`'s cache: keys
    and values of every KV head (2 sides), or an MLA model's one latent row (1 side, 1 head,
    `kv_lora_rank + qk_rope_head_dim` values)."""
    if model_type_of(config) in MLA_MODEL_TYPES:
        return 1, 1, config.kv_lora_rank + config.qk_rope_head_dim
    num_heads = config.num_attention_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    return 2, num_kv_heads, head_dim


@dataclass(frozen=True, slots=True)
class DecoderSpec:
    """The config values the decoder is built from. `num_kv_heads` and `head_dim` are the KV
    cache's: an MLA model (`mla`) caches one latent row of `mla.latent_dim` values a token."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    sliding_window: int | None
    moe: MoeSpec | None = None
    mla: MlaSpec | None = None

    @property
    def kv_sides(self) -> int:
        """What the cache keeps a token: keys and values (2), or an MLA model's latent row (1)."""
        return 1 if self.mla is not None else 2

    @property
    def rotary_dim(self) -> int:
        """The dims of a query or key head that rotate: all, or an MLA model's rope dims."""
        return self.mla.qk_rope_head_dim if self.mla is not None else self.head_dim

    @classmethod
    def from_config(cls, config) -> DecoderSpec:
        model_type = model_type_of(config)
        if model_type not in MODEL_TYPES:
            raise ValueError(f"unsupported model type {model_type!r}; supported: {', '.join(MODEL_TYPES)}")
        attention_bias = bool(getattr(config, "attention_bias", False))
        num_heads = config.num_attention_heads
        mla = MlaSpec.from_config(config, model_type) if model_type in MLA_MODEL_TYPES else None
        rope_theta, rope_scaling = rope_from_config(config)
        _, num_kv_heads, head_dim = kv_cache_row(config)
        return cls(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=config.rms_norm_eps,
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            qkv_bias=model_type == "qwen2" or attention_bias,  # MLA: q_a_proj and kv_a_proj_with_mqa
            o_bias=model_type != "qwen2" and attention_bias,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            sliding_window=_active_sliding_window(config, model_type),
            moe=MoeSpec.from_config(config, model_type),
            mla=mla,
        )


def _active_sliding_window(config, model_type: str) -> int | None:
    if model_type in ("qwen2", "qwen3", "qwen3_moe") and not getattr(config, "use_sliding_window", False):
        return None
    if model_type == "llama" or model_type in MLA_MODEL_TYPES:
        return None
    return getattr(config, "sliding_window", None)
