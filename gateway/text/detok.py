"""Incremental detokenization and stop strings, for streaming and non-streaming alike.

Both paths run the same code, so a stream's deltas always join to the non-streaming text.

Text from tokens: decoding token by token splits multi-byte characters (one Chinese character
or emoji is often two or three byte-level tokens), and a tokenizer renders a partial character
as U+FFFD. So the decoder keeps a window of ids and reports new text only once the window
decodes without a trailing U+FFFD:

    ids:   ... p p p | a b | c d
                     ^     ^
          prefix_offset    read_offset      text(a b c d) - text(a b) = the delta

`prefix_offset` starts a few tokens into the prompt so tokenizers that drop a leading space
at the start of a decode (SentencePiece) still produce it.

Stop strings: text that could still be the start of a stop string is held back until the
next piece of text either completes the stop string (generation ends there) or rules it out.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT_CHAR = "\ufffd"
PROMPT_CONTEXT_TOKENS = 5


def ids_decoder(tokenizer) -> Callable[[list[int], bool], str]:
    """`decode(ids, skip_special_tokens)` of a Hugging Face tokenizer, straight from its Rust
    backend where that is what `tokenizer.decode` computes anyway.

    The streaming path decodes a window per event; `decode`'s Python layers (converting the ids
    one by one, keyword handling) cost more than the Rust decode of a short window. The backend
    is called directly only for a fast tokenizer whose class keeps the library's `decode` and
    `_decode`, with no `decode` of its own set on the instance, and that cleans up no spaces:
    there the two are the same computation.
    """
    def through_transformers(token_ids: list[int], skip_special_tokens: bool) -> str:
        return tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    backend = decoding_backend(tokenizer)
    if backend is None:
        return through_transformers
    backend_decode = backend.decode

    def through_backend(token_ids: list[int], skip_special_tokens: bool) -> str:
        return backend_decode(token_ids, skip_special_tokens=skip_special_tokens)

    return through_backend


def decoding_backend(tokenizer):
    """The tokenizer's Rust backend where its `decode` is the same computation as the
    tokenizer's own (see `ids_decoder`), else None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    base = _fast_tokenizer_class()
    if (backend is None or base is None or not isinstance(tokenizer, base)
            or getattr(tokenizer, "clean_up_tokenization_spaces", True)
            or type(tokenizer).decode is not base.decode or type(tokenizer)._decode is not base._decode
            or "decode" in getattr(tokenizer, "__dict__", {})):
        return None
    return backend


def _fast_tokenizer_class() -> type | None:
    """transformers' class of tokenizers backed by the `tokenizers` library (renamed in v5)."""
    import transformers

    return getattr(transformers, "TokenizersBackend", None) or getattr(transformers, "PreTrainedTokenizerFast", None)


class IncrementalDetokenizer:
    """Token ids in, text out, never half a character (see the module docstring)."""

    def __init__(self, tokenizer, prompt_token_ids: Sequence[int] = (), skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self._decode = ids_decoder(tokenizer)
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def push(self, token_ids: Sequence[int]) -> str:
        """Text that the new tokens complete; empty while a character is still partial."""
        if not token_ids:
            return ""
        self.ids.extend(token_ids)
        prefix_text, new_text = self._window()
        if new_text.endswith(REPLACEMENT_CHAR) and len(token_ids) > 1:
            # Several tokens ending inside a character: one by one, so the whole characters
            # before it come out now, as they would have had the tokens come apart.
            del self.ids[-len(token_ids):]
            return "".join([self.push(token_ids[i:i + 1]) for i in range(len(token_ids))])
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return new_text[len(prefix_text):]

    def flush(self) -> str:
        """What is left when generation ends; a character cut off by the end is dropped."""
        if self.read_offset == len(self.ids):
            return ""
        prefix_text, new_text = self._window()
        self.prefix_offset = self.read_offset = len(self.ids)
        return new_text[len(prefix_text):].rstrip(REPLACEMENT_CHAR)

    def _window(self) -> tuple[str, str]:
        decode, skip = self._decode, self.skip_special_tokens
        return decode(self.ids[self.prefix_offset:self.read_offset], skip), decode(self.ids[self.prefix_offset:], skip)


class StopStringMatcher:
    """Holds text back while it may still become a stop string; cuts the text at a match.

    `push` returns the text that is safe to emit. After a match, `stop` is the string that
    matched and the text ends at it (or just after it with `include_stop_str_in_output`).
    """

    def __init__(self, stop_strings: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        assert all(stop_strings), "stop strings must be non-empty"
        self.stop_strings = list(stop_strings)
        self.include = include_stop_str_in_output
        self.longest = max((len(s) for s in self.stop_strings), default=0)
        self.text = ""
        self.num_emitted = 0
        # Text pushed unchecked (before min_tokens) is emitted at once and is never part of a
        # match, not even the start of one that the checked text completes.
        self.checked_from = 0
        self.stop: str | None = None

    def push(self, new_text: str, check: bool = True) -> str:
        """Add text; `check=False` (before min_tokens) lets stop strings pass through."""
        if self.stop is not None or not new_text:
            return ""
        search_from = max(self.checked_from, len(self.text) - self.longest + 1)
        self.text += new_text
        if not self.stop_strings:
            return self._emit_to(len(self.text))
        if check:
            match = self._earliest_match(search_from)
            if match is not None:
                position, stop = match
                self.stop = stop
                end = position + (len(stop) if self.include else 0)
                assert position >= self.num_emitted, "a held-back prefix was emitted"
                return self._emit_to(end)
            return self._emit_to(len(self.text) - self._held_back())
        self.checked_from = len(self.text)
        return self._emit_to(len(self.text))

    def flush(self) -> str:
        """At the end of generation nothing can match any more: release what was held."""
        if self.stop is not None:
            return ""
        return self._emit_to(len(self.text))

    def _emit_to(self, end: int) -> str:
        if end <= self.num_emitted:
            return ""
        out = self.text[self.num_emitted:end]
        self.num_emitted = end
        return out

    def _earliest_match(self, search_from: int) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for stop in self.stop_strings:
            position = self.text.find(stop, search_from)
            if position >= 0 and (best is None or position < best[0]):
                best = (position, stop)
        return best

    def _held_back(self) -> int:
        """Length of the longest end of the text that begins some stop string."""
        held = 0
        for stop in self.stop_strings:
            for length in range(min(len(stop) - 1, len(self.text) - self.checked_from), held, -1):
                if self.text.endswith(stop[:length]):
                    held = length
                    break
        return held


class OutputText:
    """One sample's text: detokenizer plus stop strings, fed with each delta's token ids."""

    def __init__(self, tokenizer, prompt_token_ids: Sequence[int], *, stop_strings: Sequence[str] = (),
                 include_stop_str_in_output: bool = False, skip_special_tokens: bool = True,
                 min_tokens: int = 0) -> None:
        self.detokenizer = (IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens)
                            if tokenizer is not None else None)
        self.matcher = StopStringMatcher(stop_strings, include_stop_str_in_output)
        self.min_tokens = min_tokens
        self.num_tokens = 0
        self.text = ""

    @property
    def stop(self) -> str | None:
        return self.matcher.stop

    def push(self, token_ids: Sequence[int]) -> str:
        self.num_tokens += len(token_ids)
        if self.detokenizer is None or self.matcher.stop is not None:
            return ""
        return self._append(self.matcher.push(self.detokenizer.push(token_ids),
                                              check=self.num_tokens >= self.min_tokens))

    def finish(self) -> str:
        """The text still held back, once the worker says the sample is over."""
        if self.detokenizer is None or self.matcher.stop is not None:
            return ""
        tail = self.matcher.push(self.detokenizer.flush(), check=self.num_tokens >= self.min_tokens)
        return self._append(tail + self.matcher.flush())

    def _append(self, piece: str) -> str:
        self.text += piece
        return piece
