"""The decoder families and the model runner against Hugging Face's own implementations.

Each test builds a tiny random-weight Hugging Face model, loads its state dict into ours,
runs our paged runner and compares logits (fp32, max abs diff < 1e-4) or greedy tokens.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
import transformers

from spillway.worker.attention.torch_paged import TorchAttentionBackend
from spillway.worker.runner.kv_blocks import kv_block_bytes, num_blocks_for_memory
from spillway.worker.runner.model_runner import ChunkInput, ModelRunner
from spillway.worker.models import build_model, model_class_for
from spillway.worker.models.llama import LlamaForCausalLM
from spillway.worker.models.rope_scaling import Llama3RopeScaling
from spillway.worker.models.spec import rope_from_config

TOLERANCE = 1e-4
VOCAB = 300
CPU = torch.device("cpu")

_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)

FAMILIES = {
    "llama-tied": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(tie_word_embeddings=True)),
    "llama3-rope": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        dict(
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=500000.0,
                factor=4.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=32,
            )
        ),
    ),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, dict(head_dim=16)),
    "qwen2-bias": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, dict(tie_word_embeddings=True)),
    "qwen3-qknorm": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(head_dim=24)),
    # Trained on 16 positions, stretched 16 times (cos and sin scaled by 1.28): prompts run past 16.
    "qwen3-yarn": (
        transformers.Qwen3Config,
        transformers.Qwen3ForCausalLM,
        dict(head_dim=16, rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=16.0,
                                               original_max_position_embeddings=16)),
    ),
}


def hf_model(family: str = "llama-tied", seed: int = 0):
    """A tiny HF model with every weight random (biases and norm scales too, so loading them matters)."""
    config_class, model_class, extra = FAMILIES[family]
    config = config_class(**_COMMON, **extra)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_class(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            else:
                param.normal_(0.0, 0.2)
    return model


def our_model(hf) -> LlamaForCausalLM:
    model = build_model(hf.config, device=CPU, dtype=torch.float32)
    model.load_weights(hf.state_dict().items())
    return model


def make_runner(hf, num_blocks: int = 64, block_size: int = 4) -> ModelRunner:
    model = our_model(hf)
    return ModelRunner(model, num_blocks=num_blocks, block_size=block_size, device=CPU, dtype=torch.float32)


def hf_logits(hf, token_ids: list[int]) -> torch.Tensor:
    """HF's logits `[len(token_ids), vocab]`, one sequence, no padding."""
    with torch.no_grad():
        return hf(torch.tensor([token_ids])).logits[0].float()


def prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(length)]


def allocate(lengths: list[int], block_size: int, pool: list[int]) -> list[list[int]]:
    """Block tables for sequences of `lengths`, taking blocks from the front of `pool`."""
    tables = []
    for length in lengths:
        num_blocks = -(-length // block_size)
        tables.append(pool[:num_blocks])
        del pool[:num_blocks]
    return tables


def max_diff(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return (ours - reference).abs().max().item()


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_prefill_of_mixed_lengths_matches_hf(family):
    hf = hf_model(family)
    runner = make_runner(hf, block_size=4)
    # 1 token, exactly one block, one past a block boundary, several blocks and a ragged tail.
    prompts = [prompt(n, seed=n) for n in (1, 4, 5, 11, 17)]
    tables = allocate([len(p) for p in prompts], 4, list(range(1, 64)))

    logits = runner.execute([ChunkInput(p, 0, t) for p, t in zip(prompts, tables)])

    assert logits.shape == (len(prompts), VOCAB) and logits.dtype == torch.float32
    for row, p in enumerate(prompts):
        assert max_diff(logits[row], hf_logits(hf, p)[-1]) < TOLERANCE


@pytest.mark.parametrize("family", ["llama3-rope", "qwen3-qknorm", "qwen3-yarn"])
def test_chunked_prefill_gives_the_logits_of_one_pass(family):
    hf = hf_model(family)
    runner = make_runner(hf, block_size=4)
    tokens = prompt(19, seed=1)
    table = [9, 3, 14, 2, 30]
    reference = hf_logits(hf, tokens)

    for start, end in [(0, 7), (7, 12), (12, 19)]:  # chunks end mid-block and start mid-block
        logits = runner.execute([ChunkInput(tokens[start:end], start, table)])
        assert max_diff(logits[0], reference[end - 1]) < TOLERANCE


@pytest.mark.parametrize("family", ["llama-tied", "qwen2-bias"])
def test_cached_prefix_blocks_are_reused_by_a_second_request(family):
    hf = hf_model(family)
    runner = make_runner(hf, block_size=4)
    shared = prompt(8, seed=2)  # two full blocks
    first = shared + prompt(5, seed=3)
    second = shared + prompt(6, seed=4)
    first_table, second_tail_blocks = [5, 6, 7, 8], [11, 12]
    runner.execute([ChunkInput(first, 0, first_table)])

    # The second request's table starts with the first's two blocks; only its tail is computed,
    # in the same step as a decode of the first request (a mixed batch, decode row second).
    next_token = 42
    logits = runner.execute(
        [
            ChunkInput(second[8:], 8, first_table[:2] + second_tail_blocks),
            ChunkInput([next_token], len(first), first_table),
        ]
    )

    assert max_diff(logits[0], hf_logits(hf, second)[-1]) < TOLERANCE
    assert max_diff(logits[1], hf_logits(hf, first + [next_token])[-1]) < TOLERANCE


def greedy_decode(runner: ModelRunner, prompts: list[list[int]], tables: list[list[int]], steps: int):
    """Prefill every prompt in one step, then decode all of them together, greedily."""
    sequences = [list(p) for p in prompts]
    logits = runner.execute([ChunkInput(p, 0, t) for p, t in zip(prompts, tables)])
    for step in range(steps):
        for sequence, token in zip(sequences, logits.argmax(-1).tolist()):
            sequence.append(token)
        if step + 1 == steps:
            break
        chunks = [ChunkInput([s[-1]], len(s) - 1, t) for s, t in zip(sequences, tables)]
        logits = runner.execute(chunks)
    return [s[len(p) :] for s, p in zip(sequences, prompts)]


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_decode_of_a_mixed_batch_equals_hf_generate(family):
    hf = hf_model(family)
    runner = make_runner(hf, block_size=4)
    prompts = [prompt(n, seed=10 + n) for n in (3, 9, 14)]
    steps = 10
    tables = allocate([len(p) + steps for p in prompts], 4, list(range(1, 64)))

    ours = greedy_decode(runner, prompts, tables, steps)

    for p, generated in zip(prompts, ours):
        expected = hf.generate(
            torch.tensor([p]), max_new_tokens=steps, min_new_tokens=steps, do_sample=False, pad_token_id=0
        )
        assert generated == expected[0, len(p) :].tolist()


@pytest.mark.parametrize("block_size", [4, 16])
def test_shuffled_block_tables_over_a_dirty_cache(block_size):
    hf = hf_model("qwen3-qknorm")
    runner = make_runner(hf, num_blocks=40, block_size=block_size)
    # Leftovers of earlier requests must be masked out, never read.
    runner.kv_cache.normal_()
    prompts = [prompt(n, seed=20 + n) for n in (6, 21, 33)]
    steps = 4
    pool = list(range(40))
    random.Random(block_size).shuffle(pool)
    tables = allocate([len(p) + steps for p in prompts], block_size, pool)

    ours = greedy_decode(runner, prompts, tables, steps)

    for p, generated, table in zip(prompts, ours, tables):
        full = p + generated
        reference = hf_logits(hf, full)
        assert generated == reference[len(p) - 1 : -1].argmax(-1).tolist()
        # Recomputing the last position reads every block of the table back.
        logits = runner.execute([ChunkInput(full[-1:], len(full) - 1, table)])
        assert max_diff(logits[0], reference[-1]) < TOLERANCE


def test_padded_rows_are_neither_stored_nor_attended():
    backend = TorchAttentionBackend(block_size=4)
    kv_cache = torch.zeros(6, 1, 2, 4, 2, 8)
    torch.manual_seed(0)
    q, k, v = torch.randn(5, 4, 8), torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    # Two decodes at positions 0 and 5 (blocks [3] and [1, 2]), then three padded rows.
    slot_mapping = torch.tensor([12, 9, -1, -1, -1])
    block_tables = torch.tensor([[3, 0], [1, 2]])
    metadata = backend.build_metadata([1, 1], [0, 5], block_tables, slot_mapping)

    out = backend.forward(0, q, k, v, kv_cache, metadata)

    written = (kv_cache[:, 0] != 0).flatten(2).any(-1)  # [block, k/v]
    assert written.nonzero().tolist() == [[2, 0], [2, 1], [3, 0], [3, 1]]
    assert torch.equal(kv_cache[3, 0, 0, 0], k[0]) and torch.equal(kv_cache[2, 0, 1, 1], v[1])
    # The first sequence attends to itself alone: every head returns its own value.
    assert torch.allclose(out[0], v[0].repeat_interleave(2, dim=0))


def test_load_weights_names_a_missing_weight():
    hf = hf_model("qwen3-qknorm")
    model = build_model(hf.config, device=CPU, dtype=torch.float32)
    weights = dict(hf.state_dict())
    del weights["model.layers.1.self_attn.k_norm.weight"]

    with pytest.raises(ValueError, match=r"missing \['model\.layers\.1\.self_attn\.k_norm\.weight'\]"):
        model.load_weights(weights.items())


def test_load_weights_names_an_unexpected_weight():
    hf = hf_model("llama-tied")
    model = build_model(hf.config, device=CPU, dtype=torch.float32)
    weights = dict(hf.state_dict())
    weights["model.layers.0.self_attn.q_norm.weight"] = torch.ones(16)

    with pytest.raises(ValueError, match=r"unexpected \['model\.layers\.0\.self_attn\.q_norm\.weight'\]"):
        model.load_weights(weights.items())


def test_tied_lm_head_shares_the_embedding_and_is_optional_in_the_checkpoint():
    hf = hf_model("qwen2-bias")
    model = build_model(hf.config, device=CPU, dtype=torch.float32)
    model.load_weights((n, t) for n, t in hf.state_dict().items() if n != "lm_head.weight")

    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, hf.lm_head.weight)


def test_model_class_for_chooses_by_model_type_or_architecture_and_rejects_others():
    assert model_class_for(transformers.Qwen3Config()) is LlamaForCausalLM
    by_architecture = SimpleNamespace(model_type="", architectures=["MistralForCausalLM"])
    assert model_class_for(by_architecture) is LlamaForCausalLM
    with pytest.raises(ValueError, match="gpt2.*llama, mistral, qwen2, qwen3"):
        model_class_for(transformers.GPT2Config())


def test_rope_parameters_come_from_either_config_style():
    scaling = dict(
        factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
    )
    expected = (500000.0, Llama3RopeScaling(8.0, 1.0, 4.0, 8192))
    new_style = SimpleNamespace(rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, **scaling))
    old_style = SimpleNamespace(rope_theta=500000.0, rope_scaling=dict(type="llama3", **scaling))
    assert rope_from_config(new_style) == expected
    assert rope_from_config(old_style) == expected
    assert rope_from_config(SimpleNamespace(rope_theta=1e6, rope_scaling=None)) == (1e6, None)
    with pytest.raises(ValueError, match="'dynamic'; supported: default, llama3, yarn"):
        rope_from_config(SimpleNamespace(rope_parameters=dict(rope_type="dynamic", rope_theta=1e4, factor=4.0)))


def test_contexts_past_a_sliding_window_are_refused():
    config = transformers.MistralConfig(**_COMMON, head_dim=16, sliding_window=8)
    runner = ModelRunner(build_model(config, device=CPU, dtype=torch.float32), num_blocks=8, block_size=4,
                         device=CPU, dtype=torch.float32)
    assert runner.execute([ChunkInput(prompt(8, seed=0), 0, [0, 1])]).shape == (1, VOCAB)
    with pytest.raises(ValueError, match="sliding window of 8"):
        runner.execute([ChunkInput([7], 8, [0, 1, 2])])


def test_kv_pool_sizing():
    config = transformers.LlamaConfig(**{**_COMMON, "num_hidden_layers": 3})
    # 3 layers x (k, v) x 16 tokens x 2 kv heads x 16 dims x 2 bytes
    assert kv_block_bytes(config, 16, torch.bfloat16) == 3 * 2 * 16 * 2 * 16 * 2
    assert num_blocks_for_memory(config, 16, torch.bfloat16, 10 * 6144 + 6143) == 10
