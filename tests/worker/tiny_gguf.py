"""Tiny GGUF files written with the `gguf` package from a transformers model's weights, laid
out as llama.cpp's converter lays them out (float32, so nothing is lost)."""

from __future__ import annotations

from pathlib import Path

import torch


def write_qwen3_moe_gguf(hf_model, path: Path) -> Path:
    """A `qwen3moe` GGUF of a transformers Qwen3-MoE whose layers are all sparse; returns the file."""
    config = hf_model.config
    assert not config.mlp_only_layers and config.decoder_sparse_step == 1, "llama.cpp's qwen3moe is sparse throughout"
    return _write(hf_model, path, "qwen3moe", config.moe_intermediate_size, config.num_experts)


def write_mixtral_gguf(hf_model, path: Path, *, expert_by_expert: bool = False) -> Path:
    """A Mixtral GGUF as llama.cpp writes one: architecture "llama" with experts, the q and k
    rows of each head interleaved (llama.cpp's rotary layout); `expert_by_expert`: one tensor an
    expert (`blk.N.ffn_gate.E.weight`), as files written before llama.cpp stacked them; returns the file."""
    config = hf_model.config
    return _write(hf_model, path, "llama", config.intermediate_size, config.num_local_experts, expert_by_expert)


def _write(hf_model, path: Path, architecture: str, expert_width: int, num_experts: int,
           expert_by_expert: bool = False) -> Path:
    """With a byte-level BPE tokenizer over the model's vocabulary (the 256 byte symbols, one
    merge of the first two, fillers, then BOS and EOS last)."""
    import gguf

    config = hf_model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_name(f"tiny-{config.model_type}")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_expert_count(num_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_expert_feed_forward_length(expert_width)
    _add_byte_level_tokenizer(writer, config.vocab_size)
    tensors = _gguf_tensors(hf_model.state_dict(), config, expert_width, architecture == "llama")
    for name, tensor in (_expert_by_expert(tensors) if expert_by_expert else tensors):
        writer.add_tensor(name, tensor.detach().float().contiguous().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_byte_level_tokenizer(writer, vocab_size: int) -> None:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    symbols = list(bytes_to_unicode().values())
    merged = symbols[0] + symbols[1]
    fillers = [f"<filler{i}>" for i in range(vocab_size - len(symbols) - 3)]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(symbols + [merged] + fillers + ["<|endoftext|>", "<|im_end|>"])
    writer.add_token_types([1] * (len(symbols) + 1) + [3] * (len(fillers) + 2))  # normal, then control
    writer.add_token_merges([f"{symbols[0]} {symbols[1]}"])
    writer.add_bos_token_id(vocab_size - 2)
    writer.add_eos_token_id(vocab_size - 1)


def _interleaved_halves(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp's q/k layout for "llama": each head's two rotary halves interleaved row by row."""
    rows, columns = weight.shape
    return weight.reshape(num_heads, 2, rows // num_heads // 2, columns).transpose(1, 2).reshape(rows, columns)


def _gguf_tensors(state: dict[str, torch.Tensor], config, expert_width: int, interleave_qk: bool):
    """(GGUF name, tensor) in llama.cpp's names; experts stacked `[E, rows, columns]`."""
    yield "token_embd.weight", state["model.embed_tokens.weight"]
    yield "output_norm.weight", state["model.norm.weight"]
    yield "output.weight", state["lm_head.weight"]
    heads = {"q": config.num_attention_heads, "k": config.num_key_value_heads}
    for layer in range(config.num_hidden_layers):
        ours, theirs = f"model.layers.{layer}.", f"blk.{layer}."
        yield theirs + "attn_norm.weight", state[ours + "input_layernorm.weight"]
        for short, projection in [("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj"), ("output", "o_proj")]:
            weight = state[ours + f"self_attn.{projection}.weight"]
            if interleave_qk and short in heads:
                weight = _interleaved_halves(weight, heads[short])
            yield theirs + f"attn_{short}.weight", weight
        if ours + "self_attn.q_norm.weight" in state:
            yield theirs + "attn_q_norm.weight", state[ours + "self_attn.q_norm.weight"]
            yield theirs + "attn_k_norm.weight", state[ours + "self_attn.k_norm.weight"]
        yield theirs + "ffn_norm.weight", state[ours + "post_attention_layernorm.weight"]
        yield theirs + "ffn_gate_inp.weight", state[ours + "mlp.gate.weight"]
        gate_up = state[ours + "mlp.experts.gate_up_proj"]
        yield theirs + "ffn_gate_exps.weight", gate_up[:, :expert_width]
        yield theirs + "ffn_up_exps.weight", gate_up[:, expert_width:]
        yield theirs + "ffn_down_exps.weight", state[ours + "mlp.experts.down_proj"]


def _expert_by_expert(tensors):
    """Stacked `blk.N.ffn_{gate,up,down}_exps` split into llama.cpp's older `blk.N.ffn_{part}.E`."""
    for name, tensor in tensors:
        if name.endswith("_exps.weight"):
            block, part = name.split(".ffn_")[0], name.split(".ffn_")[1].removesuffix("_exps.weight")
            for expert, one in enumerate(tensor):
                yield f"{block}.ffn_{part}.{expert}.weight", one
        else:
            yield name, tensor
