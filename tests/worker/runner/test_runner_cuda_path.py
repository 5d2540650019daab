"""The runner's CUDA path, run on the CPU: Triton kernels through Triton's interpreter, and the
decode graphs' fixed input views run eagerly in place of captured graphs.

Everything a captured graph reads (bucket padding, the static block-table buffer, tensors-only
decode metadata) is exercised here; the GPU tests add the capture and replay themselves.
"""

from __future__ import annotations

import functools
import random

import pytest
import torch
import transformers

from spillway.worker.runner.cuda_graphs import GraphBuckets, decode_buckets
from spillway.worker.kv_tier.step_graphs import StepGraphs
from spillway.worker.runner.model_runner import ChunkInput, ModelRunner, TokenFeed
from spillway.worker.models.llama import LlamaForCausalLM

CPU = torch.device("cpu")
BLOCK = 16
VOCAB = 300


def test_decode_buckets_are_small_powers_of_two_then_multiples_of_eight_then_the_maximum():
    assert decode_buckets(1) == [1]
    assert decode_buckets(3) == [1, 2, 3]
    assert decode_buckets(8) == [1, 2, 4, 8]
    assert decode_buckets(12) == [1, 2, 4, 8, 12]
    assert decode_buckets(256) == [1, 2, 4, *range(8, 257, 8)]
    graphs = StepGraphs(decode_buckets(12), CPU)
    assert [graphs.bucket_for(n) for n in (1, 3, 8, 9, 12)] == [1, 4, 8, 12, 12]
    graphs = StepGraphs(decode_buckets(256), CPU)
    assert [graphs.bucket_for(n) for n in (5, 17, 200, 249)] == [8, 24, 200, 256]


class EagerGraphs(StepGraphs):
    """Runs each bucket's step eagerly over the same fixed views a graph would read: the decode
    step by batch size, or the prefill, cascade, short cascade or verify step by token count
    (`kind`)."""

    def __init__(self, runner: ModelRunner, max_batch_size: int = 0, *, kind: str = "decode") -> None:
        buckets = GraphBuckets.plan(max(max_batch_size, 1), runner.max_num_seqs, runner.inputs.capacity[0],
                                    verify=True, cascade=True, short_query_tokens=runner.short_query_tokens)
        super().__init__(getattr(buckets, kind), CPU, kind=kind)
        graphs = runner.cuda_graphs
        steps = {"decode": graphs.decode_step, "prefill": graphs.prefill_step, "cascade": graphs.cascade_step,
                 "short_cascade": graphs.short_cascade_step, "verify": graphs.verify_step}
        step_for = functools.partial(steps[kind], runner.kv_cache)
        self.steps = {bucket: step_for(bucket) for bucket in self.buckets}
        self.replayed: list[int] = []

    def replay(self, bucket: int, layer_ready=None) -> torch.Tensor:
        self.replayed.append(bucket)
        return self.steps[bucket]() if layer_ready is None else self.steps[bucket](layer_ready)


def qwen3_pair(seed: int = 0):
    """A tiny random HF Qwen3 (head_dim a power of two, as the kernels need) and ours on kernels."""
    from spillway.worker.attention.triton_paged import TritonAttentionBackend
    from spillway.worker.models.layers import kernel_ops

    config = transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=256, rms_norm_eps=1e-6,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    hf = transformers.Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            param.uniform_(0.5, 1.5) if "norm" in name else param.normal_(0.0, 0.2)
    model = LlamaForCausalLM.build(config, device=CPU, dtype=torch.float32, ops=kernel_ops())
    model.load_weights(hf.state_dict().items())
    runner = ModelRunner(model, num_blocks=24, block_size=BLOCK, device=CPU, dtype=torch.float32,
                         backend=TritonAttentionBackend(BLOCK), max_num_seqs=4, max_num_batched_tokens=128,
                         max_model_len=128)
    return hf, runner


def hf_last_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0, -1]


def test_kernel_path_prefill_then_padded_decode_buckets_match_hf():
    hf, runner = qwen3_pair()
    rng = random.Random(0)
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (5, 16, 33)]
    # Block 0 belongs to a real sequence: a padded row writing to slot 0 would corrupt it.
    tables = [[0, 9], [3, 17, 4], [11, 2, 7, 20]]
    logits = runner.execute([ChunkInput(p, 0, t) for p, t in zip(prompts, tables)])
    for row, p in enumerate(prompts):
        assert (logits[row] - hf_last_logits(hf, p)).abs().max().item() < 1e-4

    runner.cuda_graphs.decode = EagerGraphs(runner, max_batch_size=4)
    sequences = [p + [token] for p, token in zip(prompts, logits.argmax(-1).tolist())]
    for step in range(3):
        logits = runner.execute([ChunkInput([s[-1]], len(s) - 1, t) for s, t in zip(sequences, tables)])
        assert logits.shape == (3, VOCAB)
        for row, s in enumerate(sequences):
            assert (logits[row] - hf_last_logits(hf, s)).abs().max().item() < 1e-4
        for s, token in zip(sequences, logits.argmax(-1).tolist()):
            s.append(token)
    # A lone request runs the bucket of one; three ran the bucket of four, one row padded.
    single = runner.execute([ChunkInput([sequences[0][-1]], len(sequences[0]) - 1, tables[0])])
    assert (single[0] - hf_last_logits(hf, sequences[0])).abs().max().item() < 1e-4
    assert runner.cuda_graphs.decode.replayed == [4, 4, 4, 1]


TINY_CONFIGS = {
    # Qwen3: q/k RMSNorm per head, fused with rotary and the KV store in one kernel.
    "qwen3": lambda: transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=3, head_dim=32, max_position_embeddings=256, rms_norm_eps=1e-6,
    ),
    # Llama: rotary and the KV store only; three query heads share one KV head of 16.
    "llama": lambda: transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=3,
        num_key_value_heads=1, max_position_embeddings=256, rms_norm_eps=1e-5,
    ),
    # Qwen3-MoE: layer 0 sparse (4 experts, top 2, through ops.fused_experts), layer 1 dense.
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_experts=4,
        num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1], num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6,
    ),
}


def counted(function, calls: list[int]):
    def wrapper(*args, **kwargs):
        calls.append(1)
        return function(*args, **kwargs)

    return wrapper


def runner_pair(family: str, seed: int = 0, num_blocks: int = 24, max_model_len: int = 128):
    """The same random weights behind the CPU path (plain torch) and the CUDA path (kernels),
    and a list that grows by one each time a layer runs the fused qkv kernel."""
    from dataclasses import replace

    from spillway.worker.attention.torch_paged import TorchAttentionBackend
    from spillway.worker.attention.triton_paged import TritonAttentionBackend
    from spillway.worker.models.layers import TORCH_OPS, kernel_ops

    config = TINY_CONFIGS[family]()
    fused_calls: list[int] = []
    ops = kernel_ops()
    ops = replace(ops, prepare_qkv=counted(ops.prepare_qkv, fused_calls))
    torch_model = LlamaForCausalLM.build(config, device=CPU, dtype=torch.float32, ops=TORCH_OPS)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in torch_model.named_parameters():
            if "norm" in name:
                param.copy_(torch.rand(param.shape, generator=generator) + 0.5)
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    kernel_model = LlamaForCausalLM.build(config, device=CPU, dtype=torch.float32, ops=ops)
    kernel_model.load_weights(torch_model.checkpoint_weights())
    runners = []
    for model, backend in ((torch_model, TorchAttentionBackend(BLOCK)), (kernel_model, TritonAttentionBackend(BLOCK))):
        runners.append(ModelRunner(model, num_blocks=num_blocks, block_size=BLOCK, device=CPU, dtype=torch.float32,
                                   backend=backend, max_num_seqs=4, max_num_batched_tokens=128,
                                   max_model_len=max_model_len))
    return runners[0], runners[1], fused_calls


@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen3_moe"])
def test_fused_qkv_path_matches_the_torch_path(family):
    torch_runner, kernel_runner, fused_calls = runner_pair(family)
    num_layers = kernel_runner.model.num_layers
    rng = random.Random(1)
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (5, 16, 33)]
    # Block 0 belongs to a real sequence: a padded row writing to slot 0 would corrupt it.
    tables = [[0, 9], [3, 17, 4], [11, 2, 7, 20]]
    chunks = [ChunkInput(p, 0, t) for p, t in zip(prompts, tables)]
    expected, logits = torch_runner.execute(chunks), kernel_runner.execute(chunks)
    assert (logits - expected).abs().max().item() < 1e-4
    assert len(fused_calls) == num_layers

    kernel_runner.cuda_graphs.decode = EagerGraphs(kernel_runner, max_batch_size=4)
    sequences = [p + [token] for p, token in zip(prompts, expected.argmax(-1).tolist())]
    for step in range(3):
        chunks = [ChunkInput([s[-1]], len(s) - 1, t) for s, t in zip(sequences, tables)]
        expected, logits = torch_runner.execute(chunks), kernel_runner.execute(chunks)
        assert (logits - expected).abs().max().item() < 1e-4
        for s, token in zip(sequences, expected.argmax(-1).tolist()):
            s.append(token)
    # Three sequences ran the bucket of four: its padded row must have stored nothing.
    assert kernel_runner.cuda_graphs.decode.replayed == [4, 4, 4]
    assert len(fused_calls) == 4 * num_layers
    torch.testing.assert_close(kernel_runner.kv_cache, torch_runner.kv_cache, rtol=1e-5, atol=1e-5)


def test_decode_tokens_fed_from_the_device_give_the_same_logits():
    """Async scheduling feeds a decode step's tokens from the step before, on the device: in
    order (one copy) or some rows from permuted sources (an indexed copy); graph and eager."""
    _, runner = qwen3_pair()
    rng = random.Random(1)
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (5, 16, 33)]
    tables = [[0, 9], [3, 17, 4], [11, 2, 7, 20]]
    runner.execute([ChunkInput(p, 0, t) for p, t in zip(prompts, tables)])
    next_tokens = [7, VOCAB - 1, 42]
    real = [ChunkInput([tok], len(p), t) for p, tok, t in zip(prompts, next_tokens, tables)]
    sampled = torch.tensor([VOCAB - 1, 7, 42, 5])  # the step before's rows: 1, 0, 2 hold the tokens
    in_order = TokenFeed([0, 1, 2], [0, 1, 2], torch.tensor(next_tokens))
    permuted = TokenFeed([0, 1], [1, 0], sampled)
    for graphs in (None, EagerGraphs(runner, max_batch_size=4)):
        runner.cuda_graphs.decode = graphs
        expected = runner.execute(real).clone()
        for feed in (in_order, permuted):
            placeholders = [ChunkInput([0] if row in feed.rows else c.token_ids, c.start, c.slot_table)
                            for row, c in enumerate(real)]
            got = runner.execute(placeholders, feed)
            assert (got - expected).abs().max().item() < 1e-5
        unfed = runner.execute([ChunkInput([0], c.start, c.slot_table) for c in real])
        assert (unfed - expected).abs().max().item() > 1e-3  # the placeholder alone would not do
