"""What a tensor-parallel size needs of the model and of the other settings, checked by the
gateway (before a worker starts, with the flag's name) and by the worker (before its ranks
start). The worker's sharding (worker/models/tensor_parallel.py) splits query heads, KV heads
(replicating them when fewer than the ranks and dividing their number), the MLP's intermediate
size and a mixture of experts' expert width (Qwen3-MoE's `moe_intermediate_size`; Mixtral's
is its `intermediate_size`) evenly; an MLA model's (DeepSeek V2/V3) query heads split and its
latent row is every rank's. Imports only the standard library."""

from __future__ import annotations

from collections.abc import Mapping


def layout_problems(size: int, config: Mapping) -> list[str]:
    """Why `size` ranks cannot split the model of Hugging Face `config` (a config.json's values)."""
    heads = config["num_attention_heads"]
    # MLA (DeepSeek V2/V3): one latent row a token, every rank's whole; only the query heads split.
    kv_heads = 1 if config.get("kv_lora_rank") else config.get("num_key_value_heads") or heads
    intermediate = config["intermediate_size"]
    problems = []
    if heads % size:
        problems.append(f"{size} does not divide the model's {heads} attention heads")
    if kv_heads % size if kv_heads >= size else size % kv_heads:
        problems.append(f"{size} and the model's {kv_heads} KV heads do not divide one another (the KV heads "
                        f"are split across the ranks, or replicated when fewer)")
    if intermediate % size:
        problems.append(f"{size} does not divide the model's intermediate size {intermediate}")
    expert_width = config.get("moe_intermediate_size")
    if expert_width and expert_width % size:
        problems.append(f"{size} does not divide the model's experts' intermediate size {expert_width}")
    return problems
