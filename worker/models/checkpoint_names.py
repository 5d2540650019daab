"""Which part of which parameter each checkpoint tensor fills.

Our parameters carry Hugging Face's names except where we fuse: q/k/v into `qkv_proj` and
gate/up into `gate_up_proj` (stacked along the output rows), and the experts of a
mixture-of-experts layer into three-dimensional tensors, which checkpoints list one by one:

    checkpoint tensor                                   our parameter[index]
    ...self_attn.{q,k,v}_proj.weight                    ...self_attn.qkv_proj.weight[rows]
    ...mlp.{gate,up}_proj.weight                        ...mlp.gate_up_proj.weight[rows]
    ...mlp.experts.N.{gate,up}_proj.weight  (Qwen3-MoE) ...mlp.experts.gate_up_proj[N, rows]
    ...mlp.experts.N.down_proj.weight                   ...mlp.experts.down_proj[N]
    ...block_sparse_moe.gate.weight         (Mixtral)   ...mlp.gate.weight
    ...block_sparse_moe.experts.N.w1/w3/w2.weight       as gate_proj / up_proj / down_proj

transformers 5 keeps the experts fused in memory under our own names (`mlp.experts.gate_up_proj`,
Mixtral's `mlp.gate.weight`): a state dict of its model loads too, each such tensor standing
for every per-expert tensor it holds. Its `save_pretrained` writes the per-expert names.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass(frozen=True, slots=True)
class Target:
    """The checkpoint tensor is `param[index]`, a view (integers and slices only)."""

    param: nn.Parameter
    index: tuple[int | slice, ...] = ()

    def view(self) -> torch.Tensor:
        return self.param.detach()[self.index]


@dataclass(frozen=True, slots=True)
class ExpertNames:
    """How a family's checkpoints name a mixture-of-experts block and its experts' projections."""

    block: str
    gate: str
    up: str
    down: str


QWEN_EXPERTS = ExpertNames("mlp", "gate_proj", "up_proj", "down_proj")
MIXTRAL_EXPERTS = ExpertNames("block_sparse_moe", "w1", "w3", "w2")
EXPERT_NAMES = {"mixtral": MIXTRAL_EXPERTS}


@dataclass(slots=True)
class CheckpointNames:
    """`targets`: every tensor a checkpoint must hold. `aliases`: transformers 5's fused names,
    each filling a whole parameter and standing for the `targets` names it covers."""

    targets: dict[str, Target] = field(default_factory=dict)
    aliases: dict[str, tuple[Target, tuple[str, ...]]] = field(default_factory=dict)


# Our fused projection → the checkpoint's projections, stacked along the output rows in order.
_FUSED_SHARDS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


def checkpoint_names(model: nn.Module, qkv_rows: list[int], experts: ExpertNames) -> CheckpointNames:
    """The checkpoint names of `model`'s parameters. `qkv_rows`: the q, k and v rows of a
    `qkv_proj` (a tensor-parallel shard's own)."""
    names = CheckpointNames()
    for name, param in model.named_parameters(remove_duplicate=False):
        # A tensor-parallel shard wraps some layers (tensor_parallel.py) around their `linear`,
        # and its mixture-of-experts blocks around their `moe`.
        name = name.replace(".linear.", ".").replace(".moe.", ".")
        module_path, projection, kind = ([""] * 3 + name.rsplit(".", 2))[-3:]
        if projection == "experts":
            _add_experts(names, module_path, kind, param, experts)
        elif projection == "gate" and experts.block != "mlp":  # a router, under the family's block name
            renamed = f"{_renamed_block(module_path, experts)}.gate.{kind}"
            names.targets[renamed] = Target(param)
            names.aliases[name] = (Target(param), (renamed,))
        elif projection in _FUSED_SHARDS:
            rows = qkv_rows if projection == "qkv_proj" else [param.shape[0] // 2] * 2
            offset = 0
            for shard_name, count in zip(_FUSED_SHARDS[projection], rows):
                names.targets[f"{module_path}.{shard_name}.{kind}"] = Target(param, (slice(offset, offset + count),))
                offset += count
        else:
            names.targets[name] = Target(param)
    return names


def _add_experts(names: CheckpointNames, block_path: str, kind: str, param: nn.Parameter,
                 experts: ExpertNames) -> None:
    """`kind` is "gate_up_proj" `[E, 2I, H]` or "down_proj" `[E, H, I]`."""
    prefix = f"{_renamed_block(block_path, experts)}.experts"
    covered = []
    for expert in range(param.shape[0]):
        if kind == "down_proj":
            parts = {experts.down: (expert,)}
        else:
            width = param.shape[1] // 2
            parts = {experts.gate: (expert, slice(0, width)), experts.up: (expert, slice(width, 2 * width))}
        for projection, index in parts.items():
            name = f"{prefix}.{expert}.{projection}.weight"
            names.targets[name] = Target(param, index)
            covered.append(name)
    names.aliases[f"{block_path}.experts.{kind}"] = (Target(param), tuple(covered))


def _renamed_block(block_path: str, experts: ExpertNames) -> str:
    """"model.layers.3.mlp" as the family's checkpoints name it."""
    return block_path.rsplit(".", 1)[0] + "." + experts.block
