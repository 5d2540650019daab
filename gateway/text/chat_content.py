"""Chat messages' own strings tokenized as text, never as special tokens.

A chat template wraps each message in special tokens (`<|im_start|>user\\n...<|im_end|>`).
Tokenizing the rendered conversation as one string would also turn a message that contains the
text "<|im_end|>" into that token, so a user could close their turn and write a system turn of
their own. Where a message's content or name holds a special token's text, the conversation is
rendered again with a placeholder in place of each such string; the special tokens found in
that rendering are the template's own:

    placeholders:  <|im_start|> user\\n[P0] <|im_end|> \\n <|im_start|> assistant\\n
                   └ template ┘└ text ───┘└ template ┘└──┘└ template ┘└ text ───┘

Each stretch of text between them, its placeholders replaced by the strings, is tokenized with
special-token matching off. That is exact where tokenizing the stretches one by one gives what
tokenizing the whole gives (checked on the placeholder rendering each time) and the template
copies the strings unchanged (checked against the real rendering); otherwise the request is
refused. Conversations without special-token text never come here, so their token ids are
what tokenizing the rendered text gives.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable, Sequence
from functools import cached_property

USER_FIELDS = ("content", "name")
CANNOT_ENCODE = ("a message holds special-token text, and this tokenizer cannot encode it as plain text "
                 "(the server's --allow-special-tokens-in-content lets it through)")


class ContentAsText:
    """Tokenizes rendered conversations whose messages hold special-token text, that text as text."""

    def __init__(self, tokenizer) -> None:
        self.backend = getattr(tokenizer, "backend_tokenizer", None)
        special = [(token_id, token.content) for token_id, token in tokenizer.added_tokens_decoder.items()
                   if token.special]
        self.special_ids = frozenset(token_id for token_id, _ in special)
        self.special_texts = tuple(sorted({text for _, text in special}))

    def holds_special_text(self, messages: Sequence[dict]) -> bool:
        return any(special in value for value in _user_strings(messages) for special in self.special_texts)

    @cached_property
    def _text_only(self):
        """A copy of the backend that matches no special tokens (the original stays shared by
        threads that tokenize as usual)."""
        copy = type(self.backend).from_str(self.backend.to_str())
        copy.encode_special_tokens = True
        return copy

    def encode(self, messages: Sequence[dict], rendered: str, render: Callable[[list[dict]], str]) -> list[int]:
        """The token ids of `rendered` (`render(messages)`), the messages' strings as text."""
        if self.backend is None:
            raise ValueError(CANNOT_ENCODE)
        marker = uuid.uuid4().hex
        strings: list[str] = []
        marked = render([_with_placeholders(message, marker, strings) for message in messages])
        placeholder = re.compile(r"\[" + marker + r"(\d+)\]")

        def restore(text: str) -> str:
            return placeholder.sub(lambda match: strings[int(match.group(1))], text)

        pieces = self._split_at_special_tokens(marked)
        if "".join(restore(p) if isinstance(p, str) else p[1] for p in pieces) != rendered:
            raise ValueError("a message holds special-token text, and this chat template changes message "
                             "text, so it cannot be kept as plain text")
        token_ids: list[int] = []
        for piece in pieces:
            if isinstance(piece, str):
                token_ids += self._text_only.encode(restore(piece), add_special_tokens=False).ids
            else:
                token_ids.append(piece[0])
        return token_ids

    def _split_at_special_tokens(self, text: str) -> list[str | tuple[int, str]]:
        """`text` as stretches of text and (id, text) special tokens, where tokenizing the
        stretches one by one gives exactly what tokenizing `text` gives."""
        encoding = self.backend.encode(text, add_special_tokens=False)
        pieces: list[str | tuple[int, str]] = []
        start = 0
        for token_id, (begin, end) in zip(encoding.ids, encoding.offsets):
            if token_id in self.special_ids:
                if begin > start:
                    pieces.append(text[start:begin])
                pieces.append((token_id, text[begin:end]))
                start = end
        if start < len(text):
            pieces.append(text[start:])
        again = [i for p in pieces for i in (self.backend.encode(p, add_special_tokens=False).ids
                                              if isinstance(p, str) else [p[0]])]
        if again != encoding.ids:
            raise ValueError(CANNOT_ENCODE)
        return pieces


def _user_strings(messages: Sequence[dict]):
    for message in messages:
        for field in USER_FIELDS:
            value = message.get(field)
            if isinstance(value, str):
                yield value


def _with_placeholders(message: dict, marker: str, strings: list[str]) -> dict:
    """The message with its strings replaced by `[<marker><index>]`, each kept in `strings`."""
    copy = dict(message)
    for field in USER_FIELDS:
        value = message.get(field)
        if isinstance(value, str) and value:
            copy[field] = f"[{marker}{len(strings)}]"
            strings.append(value)
    return copy
