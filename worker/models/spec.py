"""What a Llama-shaped decoder is, read from its Hugging Face config: the family (by
`model_type` or architecture), rotary parameters, and every size and flag the model is built
from (`DecoderSpec`), with its experts where it is a mixture of experts (`MoeSpec`)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from spillway.worker.models.rope_scaling import ROPE_TYPES, Llama3RopeScaling, RopeScaling, YarnRopeScaling
from spillway.worker.models.routers import GroupedTopK

ARCHITECTURE_MODEL_TYPES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
}
MODEL_TYPES = tuple(ARCHITECTURE_MODEL_TYPES.values())


def model_type_of(config) -> str:
    """The family named by `config.model_type`, else by its first known architecture."""
    model_type = getattr(config, "model_type", "") or ""
    if model_type in MODEL_TYPES:
        return model_type
    for architecture in getattr(config, "architectures", None) or ():
        if architecture in ARCHITECTURE_MODEL_TYPES:
            return ARCHITECTURE_MODEL_TYPES[architecture]
    return model_type


def rope_from_config(config) -> tuple[float, RopeScaling | None]:
    """`(rope_theta, scaling)` from `rope_parameters` (transformers 5) or the older attributes."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    legacy = dict(getattr(config, "rope_scaling", None) or {})
    theta = params.get("rope_theta") or getattr(config, "rope_theta", None) or 10000.0
    scaling = params if params.get("rope_type", params.get("type", "default")) != "default" else legacy
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
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
        """The experts of a `qwen3_moe` or `mixtral` config; None for the dense families (and a
        `qwen3_moe` config without a sparse layer)."""
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


def _qwen3_moe_sparse_layers(config) -> tuple[int, ...]:
    """As transformers decides: every `decoder_sparse_step`-th layer (counting from 1) that is
    not in `mlp_only_layers`, where the model has experts at all."""
    mlp_only = set(getattr(config, "mlp_only_layers", None) or ())
    step = getattr(config, "decoder_sparse_step", 1) or 1
    if not config.num_experts:
        return ()
    return tuple(i for i in range(config.num_hidden_layers) if i not in mlp_only and (i + 1) % step == 0)


@dataclass(frozen=True, slots=True)
class DecoderSpec:
    """The config values the decoder is built from."""

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

    @classmethod
    def from_config(cls, config) -> DecoderSpec:
        model_type = model_type_of(config)
        if model_type not in MODEL_TYPES:
            raise ValueError(f"unsupported model type {model_type!r}; supported: {', '.join(MODEL_TYPES)}")
        attention_bias = bool(getattr(config, "attention_bias", False))
        num_heads = config.num_attention_heads
        rope_theta, rope_scaling = rope_from_config(config)
        return cls(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // num_heads,
            rms_norm_eps=config.rms_norm_eps,
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=model_type != "qwen2" and attention_bias,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            sliding_window=_active_sliding_window(config, model_type),
            moe=MoeSpec.from_config(config, model_type),
        )


def _active_sliding_window(config, model_type: str) -> int | None:
    if model_type in ("qwen2", "qwen3", "qwen3_moe") and not getattr(config, "use_sliding_window", False):
        return None
    return getattr(config, "sliding_window", None) if model_type != "llama" else None
