"""Incremental detokenization and stop strings, with the default model's real tokenizer."""

from __future__ import annotations

import pytest

from spillway.gateway.text.detok import IncrementalDetokenizer, OutputText, StopStringMatcher
from spillway.protocol.local import model_files

MIXED = "Hello 世界! Emoji: 😀👍🏽 and 你好，朋友。 Done: ünïcödé ✓"


@pytest.fixture(scope="module")
def tokenizer():
    return model_files.load_tokenizer(model_files.resolve_model(None))


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_text_splits_characters_across_tokens(tokenizer):
    # The premise of the tests below: single tokens of this text decode to U+FFFD.
    assert any("\ufffd" in tokenizer.decode([t]) for t in encode(tokenizer, MIXED))


@pytest.mark.parametrize("chunk", [1, 2, 3, 5])
def test_streamed_pieces_never_hold_half_a_character(tokenizer, chunk):
    prompt = encode(tokenizer, "Say something:")
    ids = encode(tokenizer, MIXED)
    detok = IncrementalDetokenizer(tokenizer, prompt)
    pieces = [detok.push(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    pieces.append(detok.flush())
    assert all("\ufffd" not in piece for piece in pieces)
    assert "".join(pieces) == MIXED == tokenizer.decode(ids)


def test_a_character_cut_off_by_the_end_is_dropped(tokenizer):
    ids = encode(tokenizer, "ok 😀")
    detok = IncrementalDetokenizer(tokenizer)
    text = detok.push(ids[:-1]) + detok.flush()  # the emoji's last byte never came
    assert text == "ok "  # the space shares a token with the emoji's first byte


def test_special_tokens_are_skipped(tokenizer):
    eos = tokenizer.eos_token_id
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=True)
    assert detok.push(encode(tokenizer, "Paris.")) + detok.push([eos]) + detok.flush() == "Paris."


def test_stop_string_prefix_is_held_back_until_ruled_out():
    matcher = StopStringMatcher(["STOP"])
    assert matcher.push("abc S") == "abc "
    assert matcher.push("T") == ""
    assert matcher.push("x") == "STx"
    assert matcher.stop is None
    assert matcher.push("yST") == "y"
    assert matcher.push("OP and more") == ""
    assert matcher.stop == "STOP"
    assert matcher.text[:matcher.num_emitted] == "abc STxy"


def test_earliest_stop_string_wins_and_can_be_included():
    matcher = StopStringMatcher(["world", "lo w"], include_stop_str_in_output=True)
    assert matcher.push("hello world") == "hello w"
    assert matcher.stop == "lo w"


def test_flush_releases_held_text_when_nothing_can_match():
    matcher = StopStringMatcher(["</answer>"])
    assert matcher.push("42 </ans") == "42 "
    assert matcher.flush() == "</ans"


def test_output_text_stops_inside_a_multibyte_run(tokenizer):
    ids = encode(tokenizer, "先生 你好，朋友。 more text")
    output = OutputText(tokenizer, [], stop_strings=["，"])
    streamed = "".join(output.push([t]) for t in ids)
    assert output.stop == "，"
    assert streamed == output.text == "先生 你好"
    assert output.finish() == ""


def test_min_tokens_lets_early_stop_strings_pass(tokenizer):
    ids = encode(tokenizer, "a, b, c")
    output = OutputText(tokenizer, [], stop_strings=[","], min_tokens=3)
    text = "".join(output.push([t]) for t in ids) + output.finish()
    assert output.stop == ","
    assert text == "a, b"


def test_a_stop_string_never_begins_in_text_before_min_tokens():
    # "ab": "a" passed before min_tokens was reached, so the checked "b" cannot complete a match
    # (before, the match began inside text already emitted).
    matcher = StopStringMatcher(["ab"])
    assert matcher.push("xa", check=False) == "xa"
    assert matcher.push("b a", check=True) == "b "
    assert matcher.stop is None
    assert matcher.push("b!") == ""
    assert matcher.stop == "ab" and matcher.text[:matcher.num_emitted] == "xab "
