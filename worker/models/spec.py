"""What a Llama-shaped decoder is, read from its Hugging Face config: the family (by
`model_type` or architecture), rotary parameters, and every size and flag the model is built
from (`DecoderSpec`)."""

from __future__ import annotations

from dataclasses import dataclass

from spillway.worker.models.layers import Llama3RopeScaling

ARCHITECTURE_MODEL_TYPES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
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


def rope_from_config(config) -> tuple[float, Llama3RopeScaling | None]:
    """`(rope_theta, scaling)` from `rope_parameters` (transformers 5) or the older attributes."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    legacy = dict(getattr(config, "rope_scaling", None) or {})
    theta = params.get("rope_theta") or getattr(config, "rope_theta", None) or 10000.0
    scaling = params if params.get("rope_type", params.get("type", "default")) != "default" else legacy
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return float(theta), None
    if rope_type == "llama3":
        return float(theta), Llama3RopeScaling(
            factor=float(scaling["factor"]),
            low_freq_factor=float(scaling["low_freq_factor"]),
            high_freq_factor=float(scaling["high_freq_factor"]),
            original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
        )
    raise ValueError(f"unsupported rope type {rope_type!r}; supported: default, llama3")


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
    rope_scaling: Llama3RopeScaling | None
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    sliding_window: int | None

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
            qk_norm=model_type == "qwen3",
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            sliding_window=_active_sliding_window(config, model_type),
        )


def _active_sliding_window(config, model_type: str) -> int | None:
    if model_type in ("qwen2", "qwen3") and not getattr(config, "use_sliding_window", False):
        return None
    return getattr(config, "sliding_window", None) if model_type != "llama" else None
