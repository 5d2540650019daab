"""What the mixture-of-experts benchmark and tuner share: model shapes, routing, weights laid
out as a model's layers, the traffic of a call and its time as CUDA graph replays.

A model runs each layer's experts on weights no other layer reads, so a call finds none of
its experts in L2. The cases hold several copies of the weights ("layers", each with its own
routing) and time the calls over all of them, so that each reads its experts from memory.
torch is imported where it is used.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class MoeShape:
    name: str
    num_experts: int
    hidden: int
    intermediate: int
    top_k: int


SHAPES = {
    "qwen3-30b-a3b": MoeShape("qwen3-30b-a3b", 128, 2048, 768, 8),
    "mixtral-8x7b": MoeShape("mixtral-8x7b", 8, 4096, 14336, 2),
}


def expert_bytes(shape: MoeShape, element_size: int, row_scales: bool = False) -> int:
    """One expert's weights: gate, up and down (`row_scales`: fp8 weights' float32 scale a row)."""
    scales = 4 * (2 * shape.intermediate + shape.hidden) if row_scales else 0
    return 3 * shape.hidden * shape.intermediate * element_size + scales


def flops(shape: MoeShape, num_tokens: int) -> int:
    """Multiply-adds (x2) of the three products over every token-expert pair."""
    return 2 * num_tokens * shape.top_k * 3 * shape.hidden * shape.intermediate


def traffic_bytes(shape: MoeShape, num_tokens: int, distinct_experts: float, element_size: int,
                  fp8_weights: bool = False) -> float:
    """The least a call moves: the weights of the experts it touches (a byte each, and their row
    scales, with `fp8_weights`), its input and its output (`element_size` each)."""
    weights = expert_bytes(shape, 1, row_scales=True) if fp8_weights else expert_bytes(shape, element_size)
    return distinct_experts * weights + 2 * num_tokens * shape.hidden * element_size


def layer_copies(shape: MoeShape, element_size: int, l2_bytes: int, memory_budget: int) -> int:
    """Copies of the weights enough for a T = 1 call's experts (the fewest bytes) to overflow
    L2 four times over across the copies, 2..8 of them and within `memory_budget`."""
    per_call = shape.top_k * expert_bytes(shape, element_size)
    wanted = min(8, max(2, math.ceil(4 * l2_bytes / per_call)))
    affordable = memory_budget // (shape.num_experts * expert_bytes(shape, element_size))
    return max(1, min(wanted, affordable))


def routing(num_tokens: int, num_experts: int, top_k: int, seed: int, device):
    """Softmax top-k routing of random logits: float32 weights and int64 ids, `[T, K]`."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_tokens, num_experts, generator=generator)
    weights, ids = torch.softmax(logits, dim=-1).topk(top_k, dim=-1)
    return weights.to(device), ids.to(device)


@dataclass(slots=True)
class Layer:
    """One layer's inputs: `args()` is fused_experts' positional arguments, `scales()` its scale
    arguments (fp8 weights' row scales; none for weights in hidden's dtype)."""

    hidden: object
    w13: object
    w2: object
    topk_weights: object
    topk_ids: object
    w13_scale: object = None
    w2_scale: object = None

    def args(self) -> tuple:
        return self.hidden, self.w13, self.w2, self.topk_weights, self.topk_ids

    def scales(self) -> dict:
        return {} if self.w13_scale is None else dict(w13_scale=self.w13_scale, w2_scale=self.w2_scale)


def expert_weights(shape: MoeShape, dtype, device, seed: int):
    """(w13 `[E, 2I, H]`, w2 `[E, H, I]`), scaled so activations stay near 1."""
    import torch

    generator = torch.Generator(device=device).manual_seed(seed)
    w13 = torch.randn(shape.num_experts, 2 * shape.intermediate, shape.hidden, generator=generator, device=device,
                      dtype=dtype) * shape.hidden ** -0.5
    w2 = torch.randn(shape.num_experts, shape.hidden, shape.intermediate, generator=generator, device=device,
                     dtype=dtype) * shape.intermediate ** -0.5
    return w13, w2


def fp8_expert_weights(w13, w2) -> tuple:
    """(w13, w2, w13_scale, w2_scale): the weights in float8 e4m3fn with a float32 scale per output
    row of each expert, as an FP8 model holds its experts (worker/models/fp8_experts.py)."""
    from spillway.worker.models.fp8_experts import quantize_stack

    (w13_q, w13_scale), (w2_q, w2_scale) = quantize_stack(w13), quantize_stack(w2)
    return w13_q, w2_q, w13_scale, w2_scale


def layers_for(shape: MoeShape, weights: list, num_tokens: int, dtype, device) -> list[Layer]:
    """Each weight copy, `(w13, w2)` or `fp8_expert_weights`' four, with its own hidden rows and
    routing (seeds 0, 1, ...)."""
    import torch

    layers = []
    for index, (w13, w2, *scales) in enumerate(weights):
        generator = torch.Generator().manual_seed(1000 + index)
        hidden = torch.randn(num_tokens, shape.hidden, generator=generator).to(device=device, dtype=dtype)
        topk_weights, topk_ids = routing(num_tokens, shape.num_experts, shape.top_k, index, device)
        layers.append(Layer(hidden, w13, w2, topk_weights, topk_ids, *scales))
    return layers


def distinct_experts(layers: list[Layer]) -> float:
    """Experts a call touches, on average over the layers."""
    return sum(len(set(layer.topk_ids.flatten().tolist())) for layer in layers) / len(layers)


def graph_us(calls: list, device) -> float:
    """Microseconds a call: on CUDA the calls captured once in a graph and its replays timed
    (no host launch cost, as the engine's decode graphs run them); elsewhere, one pass timed."""
    import time

    import torch

    if device.type != "cuda":
        start = time.perf_counter()
        for call in calls:
            call()
        return 1e6 * (time.perf_counter() - start) / len(calls)
    from spillway.tools.bench.ceilings import bench_ms

    for call in calls:  # compiled and warm before the capture
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    try:
        return 1e3 * bench_ms(graph.replay, warmup=10, rep=60) / len(calls)
    finally:
        del graph
