"""`LLM` on the server's client and generation code, against the fake worker (it replays a fixed
token sequence, one token per step): stop strings, min_tokens and the reasoning split as the
server does them, incremental detokenization, batches and chat (interrupts, worker death and
shutdown: test_llm_lifecycle.py)."""

from __future__ import annotations

import pytest

from fake_worker import FakeWorkerProcess
from spillway.gateway import LLM, SamplingParams
from spillway.gateway.offline import llm as llm_module
from spillway.protocol.local import model_files

REASONING = " The answer is 4. Stop here, then"
ANSWER = " It is 4. Stop. More text follows."
COUNTING = " one, two, three, four, five, six, seven."


@pytest.fixture(scope="module")
def tokenizer():
    return model_files.load_tokenizer(model_files.resolve_model(None))


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.fixture
def fake_llm(monkeypatch):
    """An LLM factory whose worker replays `script`; every LLM made is shut down afterwards."""
    made = []

    def make(script: list[int], *, step_s: float = 0.002, **kwargs) -> LLM:
        monkeypatch.setattr(llm_module, "WorkerProcess",
                            lambda config: FakeWorkerProcess(config, script, step_s=step_s))
        made.append(LLM(device="cpu", max_model_len=256, **kwargs))
        return made[-1]

    yield make
    for llm in made:
        llm.shutdown()


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs)


def test_stop_strings_never_match_inside_the_reasoning(fake_llm, tokenizer):
    think, end = encode(tokenizer, "<think>"), encode(tokenizer, "</think>")
    reasoning, answer = encode(tokenizer, REASONING), encode(tokenizer, ANSWER)
    script = think + reasoning + end + answer
    llm = fake_llm(script, enable_reasoning=True)
    out = llm.generate([[100, 200]], greedy(len(script), stop="Stop"), use_tqdm=False)[0].outputs[0]
    # "Stop" in the reasoning passes; the first one in the answer ends the sample.
    stop_token = next(i for i in range(1, len(answer) + 1) if "Stop" in tokenizer.decode(answer[:i]))
    assert out.finish_reason == "stop" and out.stop_reason == "Stop"
    assert out.token_ids == think + reasoning + end + answer[:stop_token]
    assert out.reasoning_content == REASONING
    assert out.content == " It is 4. "
    assert out.num_reasoning_tokens == len(reasoning)
    assert out.text == "<think>" + REASONING + "</think>" + " It is 4. "


def test_without_a_reasoning_parser_the_same_stop_string_ends_the_thinking(fake_llm, tokenizer):
    script = encode(tokenizer, "<think>") + encode(tokenizer, REASONING)
    llm = fake_llm(script)
    out = llm.generate([[100, 200]], greedy(len(script), stop="Stop"), use_tqdm=False)[0].outputs[0]
    assert out.text == "<think> The answer is 4. "
    assert out.reasoning_content is None and out.content is None


@pytest.mark.parametrize("min_tokens", [0, 1, 3, 4, 6])
def test_min_tokens_lets_early_stop_strings_pass(fake_llm, tokenizer, min_tokens):
    script = encode(tokenizer, COUNTING)
    llm = fake_llm(script)
    out = llm.generate([[100, 200]], greedy(len(script), stop=",", min_tokens=min_tokens),
                       use_tqdm=False)[0].outputs[0]
    # The text of the tokens before the min_tokens-th is never part of a match.
    unchecked = len(tokenizer.decode(script[:max(min_tokens - 1, 0)]))
    cut = COUNTING.index(",", unchecked)
    assert out.text == COUNTING[:cut]
    assert out.finish_reason == "stop" and out.stop_reason == ","
    assert tokenizer.decode(out.token_ids).startswith(COUNTING[:cut + 1])
    assert len(out.token_ids) >= min_tokens


def test_min_tokens_counts_the_thinking(fake_llm, tokenizer):
    think, end = encode(tokenizer, "<think>"), encode(tokenizer, "</think>")
    reasoning, answer = encode(tokenizer, REASONING), encode(tokenizer, ANSWER)
    script = think + reasoning + end + answer
    llm = fake_llm(script, enable_reasoning=True)
    # Reaching min_tokens one token into the answer: the answer's own "Stop" still ends it.
    params = greedy(len(script), stop="Stop", min_tokens=len(think + reasoning + end) + 1)
    out = llm.generate([[100, 200]], params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.content == " It is 4. "
    # Past the answer's "Stop": no more stop strings in the script, the sample runs to its end.
    params = greedy(len(script), stop="Stop", min_tokens=len(script) - 2)
    out = llm.generate([[100, 200]], params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and out.content == ANSWER and out.token_ids == script


def test_detokenization_is_incremental(fake_llm, tokenizer, monkeypatch):
    script = encode(tokenizer, COUNTING * 12)
    llm = fake_llm(script)
    hf = llm.get_tokenizer()
    decoded_ids = []
    original = hf.decode

    def counting_decode(token_ids, *args, **kwargs):
        decoded_ids.append(len(token_ids))
        return original(token_ids, *args, **kwargs)

    monkeypatch.setattr(hf, "decode", counting_decode)
    out = llm.generate([[100, 200]], greedy(len(script), stop="never there"), use_tqdm=False)[0].outputs[0]
    assert out.text == COUNTING * 12 and len(script) > 150
    # A window of a few tokens per step; decoding the whole text each step would be ~n^2 / 2.
    assert max(decoded_ids) <= 8
    assert sum(decoded_ids) <= 8 * len(script)


def test_batches_with_n_logprobs_and_params_per_prompt(fake_llm, tokenizer):
    script = encode(tokenizer, COUNTING)
    llm = fake_llm(script)
    short, long = greedy(3, n=2, logprobs=2), greedy(5)
    outputs = llm.generate([[100], [101, 102], [103]], [short, long, short], use_tqdm=False)
    assert [len(o.outputs) for o in outputs] == [2, 1, 2]
    assert [o.prompt_token_ids for o in outputs] == [[100], [101, 102], [103]]
    assert len({o.request_id for o in outputs}) == 3
    for out in (outputs[0], outputs[2]):
        assert [c.index for c in out.outputs] == [0, 1]
        for completion in out.outputs:
            assert completion.token_ids == script[:3] and completion.finish_reason == "length"
            assert completion.cumulative_logprob == pytest.approx(-1.5)
            assert [sorted(entry) for entry in completion.logprobs] == [sorted({0, 1, t}) for t in script[:3]]
            assert completion.logprobs[0][script[0]].logprob == -0.5
    assert outputs[1].outputs[0].token_ids == script[:5] and outputs[1].outputs[0].logprobs is None
    assert outputs[1].outputs[0].text == tokenizer.decode(script[:5])


def test_chat_renders_the_template_once(fake_llm, tokenizer, monkeypatch):
    llm = fake_llm(encode(tokenizer, COUNTING))
    hf = llm.get_tokenizer()
    renders = []
    original = hf.apply_chat_template

    def counting_render(*args, **kwargs):
        renders.append(kwargs.get("tokenize"))
        return original(*args, **kwargs)

    monkeypatch.setattr(hf, "apply_chat_template", counting_render)
    messages = [{"role": "user", "content": "Count."}]
    out = llm.chat(messages, greedy(4), use_tqdm=False)[0]
    assert renders == [False]
    assert out.prompt == original(messages, tokenize=False, add_generation_prompt=True)
    assert out.prompt_token_ids == encode(tokenizer, out.prompt)
