"""Reasoning models offline: thinking split from the answer, and a hard thinking budget that the
worker enforces, on the real SmolLM2 (multi-token markers) and a tiny random model whose
tokenizer has <think> and </think> as single tokens."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from spillway.gateway import LLM, SamplingParams
from spillway.gateway.text.reasoning import resolve_markers
from spillway.protocol.local import model_files

sys.path.insert(0, str(Path(__file__).parents[2] / "worker"))
from tiny_models import save_tiny_thinker, tiny_deepseek_v3, tiny_qwen3_moe  # noqa: E402

BUDGETS = [0, 1, 7, 64]
QUESTION = [{"role": "user", "content": "Why is the sky blue? Explain step by step."}]


@pytest.fixture(scope="module")
def smol_template():
    tok = model_files.load_tokenizer(model_files.resolve_model(None))
    # The model's own template, opening thinking at the start of the reply.
    return tok.chat_template + "{% if add_generation_prompt %}{{ '<think>\n' }}{% endif %}"


@pytest.fixture(scope="module")
def smol(smol_template):
    with LLM(device="cpu", dtype="float32", max_model_len=1024, enable_reasoning=True,
             chat_template=smol_template) as llm:
        yield llm


def greedy(max_tokens=100, **kwargs):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs)


def test_smollm2_budgets_cut_thinking_exactly(smol):
    # One batch: each request keeps its own budget in it, and a batch's outputs are each
    # request's alone (test_a_mixed_batch_gives_each_request_its_own_budget).
    params = [greedy()] + [greedy(thinking_budget=budget) for budget in BUDGETS]
    free, *budgeted = [o.outputs[0] for o in smol.chat([QUESTION] * len(params), params, use_tqdm=False)]
    natural = free.num_reasoning_tokens if "</think>" in free.text else float("inf")
    for budget, out in zip(BUDGETS, budgeted):
        assert out.num_reasoning_tokens == min(budget, natural), budget
        text = out.text
        thinking = text[text.index("<think>"):text.index("</think>") + len("</think>")]
        assert thinking.startswith("<think>") and thinking.endswith("</think>")
        assert out.content and out.content.strip(), "an answer follows the end marker"
        assert len(out.token_ids) == 100  # max_tokens still bounds the whole output


def test_budget_larger_than_the_thinking_changes_nothing(smol, smol_template):
    # Make the end marker a token this model writes by itself at step 9 of its greedy output.
    tok = smol.get_tokenizer()
    free = smol.chat(QUESTION, greedy(40), use_tqdm=False)[0].outputs[0].token_ids
    position = next(i for i in range(9, 30)
                    if free[i] not in free[:i] and tok.encode(tok.decode([free[i]]), add_special_tokens=False) == [free[i]])
    end = tok.decode([free[position]])
    config = {"start": "<think>", "end": end}
    with LLM(device="cpu", dtype="float32", max_model_len=1024, reasoning_config=config,
             chat_template=smol_template) as llm:
        params = [greedy(40), greedy(40, thinking_budget=position + 5), greedy(40, thinking_budget=position),
                  greedy(40, thinking_budget=3)]
        unbounded, roomy, exact, tight = [o.outputs[0] for o in llm.chat([QUESTION] * 4, params, use_tqdm=False)]
    assert unbounded.token_ids == free
    assert unbounded.num_reasoning_tokens == position
    assert roomy.token_ids == free and exact.token_ids == free
    assert tight.num_reasoning_tokens == 3 and tight.token_ids[3] == free[position]


def test_a_mixed_batch_gives_each_request_its_own_budget(smol):
    budgets = [None, 3, 10, 0, 3]
    params = [greedy(30) if b is None else greedy(30, thinking_budget=b) for b in budgets]
    batch = smol.chat([QUESTION] * len(budgets), params, use_tqdm=False)
    alone = [smol.chat(QUESTION, p, use_tqdm=False)[0].outputs[0].token_ids for p in params]
    assert [o.outputs[0].token_ids for o in batch] == alone
    counts = [o.outputs[0].num_reasoning_tokens for o in batch]
    assert counts[1:] == [3, 10, 0, 3] and counts[0] > 10


def test_bad_budgets_raise_value_error(smol):
    with pytest.raises(ValueError, match="thinking_budget"):
        SamplingParams(thinking_budget=-1)
    with pytest.raises(ValueError, match="disagree"):
        SamplingParams(thinking_budget=3, thinking_token_budget=4)
    assert SamplingParams(thinking_token_budget=4).thinking_budget == 4


def test_budget_without_a_reasoning_parser_is_refused(tiny_thinker):
    path, think, end_think = tiny_thinker
    with LLM(str(path), device="cpu", dtype="float32") as plain:
        with pytest.raises(ValueError, match="reasoning parser"):
            plain.generate([[5, 6, think]], greedy(5, thinking_budget=2), use_tqdm=False)
        assert len(plain.generate([[5, 6, think]], greedy(5), use_tqdm=False)[0].outputs[0].token_ids) == 5


def tiny_llama(vocab_size: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         eos_token_id=2, tie_word_embeddings=False)
    return LlamaForCausalLM(config)


THINKERS = {"llama": tiny_llama, "qwen3_moe": lambda vocab_size: tiny_qwen3_moe(vocab_size=vocab_size, eos_token_id=2),
            "deepseek_v3": lambda vocab_size: tiny_deepseek_v3(vocab_size=vocab_size, eos_token_id=2)}


@pytest.fixture(scope="module")
def tiny_thinker(request, tmp_path_factory):
    """A random-weight Llama (a Qwen3-MoE or a DeepSeek V3 where a test asks, indirect) whose
    tokenizer (SmolLM2's plus two added tokens) has <think> and </think> as single tokens,
    and which never closes thinking by itself."""
    family = getattr(request, "param", "llama")
    tok = model_files.load_tokenizer(model_files.resolve_model(None))
    return save_tiny_thinker(tmp_path_factory.mktemp(f"tiny-thinker-{family}"), tok, THINKERS[family])


@pytest.mark.parametrize("tiny_thinker, parser", [("llama", "qwen3"), ("qwen3_moe", "qwen3"),
                                                  ("deepseek_v3", "deepseek_r1")], indirect=["tiny_thinker"])
def test_tiny_model_with_think_tokens(tiny_thinker, parser):
    path, think, end_think = tiny_thinker
    with LLM(str(path), device="cpu", dtype="float32", enable_reasoning=True, reasoning_parser=parser) as llm:
        markers = resolve_markers(llm.get_tokenizer(), parser)
        assert markers.start_token_ids == (think,) and markers.end_token_ids == (end_think,)
        prompt = [100, 200, 300, think]
        params = [greedy(80, ignore_eos=True)] + [greedy(80, thinking_budget=b, ignore_eos=True) for b in BUDGETS]
        free, *budgeted = [o.outputs[0] for o in llm.generate([prompt] * len(params), params, use_tqdm=False)]
        assert end_think not in free.token_ids and free.num_reasoning_tokens == 80
        for budget, out in zip(BUDGETS, budgeted):
            assert out.num_reasoning_tokens == budget
            assert out.token_ids[:budget] == free.token_ids[:budget]
            assert out.token_ids[budget] == end_think
            assert len(out.token_ids) == 80 and out.content is not None
            assert out.text.startswith("<think>") and "</think>" in out.text
