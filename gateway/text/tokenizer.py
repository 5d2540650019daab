"""Prompts to token ids (chat templates included) and their prefix block hashes."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from spillway.gateway.text.chat_content import ContentAsText
from spillway.gateway.text.detok import decoding_backend
from spillway.protocol.hashing import block_hashes, root_hash
from spillway.protocol.messages import BlockHash, Ready

# Id lists longer than this decode through the backend's batch decode, which releases the GIL.
LONG_DECODE_TOKENS = 4096


@dataclass(frozen=True, slots=True)
class PromptHasher:
    """The prefix block hashes of prompts, chained from the worker's root: the one place the
    gateway and `LLM` hash (a model without a tokenizer still takes token-id prompts)."""

    block_size: int
    root: BlockHash

    @classmethod
    def of(cls, ready: Ready) -> PromptHasher:
        """Hashes the worker that sent `ready` will find: its block size, hash seed and model name."""
        return cls(ready.block_size, root_hash(ready.hash_seed, ready.model))

    def __call__(self, token_ids: Sequence[int] | bytes, cache_salt: str | None = None) -> list[BlockHash]:
        return block_hashes(token_ids, self.block_size, self.root, cache_salt)


class PromptTokenizer:
    """Wraps a Hugging Face tokenizer with what the gateway needs from it.

    Special-token text inside chat messages is tokenized as text (gateway/text/chat_content.py)
    unless `allow_special_tokens_in_content`, for deployments whose users may write control
    tokens."""

    def __init__(self, tokenizer, chat_template: str | None = None,
                 allow_special_tokens_in_content: bool = False) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self._backend = decoding_backend(tokenizer)
        self._content_as_text = None if allow_special_tokens_in_content else ContentAsText(tokenizer)
        # The most characters of text one token stands for, bounded by its vocabulary string
        # (byte-level and SentencePiece vocabularies spell each byte or character of the text it
        # covers with at least one character; added tokens are their own text). Read here, not
        # at the first long prompt: walking the vocabulary holds the GIL for ~30 ms.
        self.max_token_chars = max(map(len, tokenizer.get_vocab()))

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=True)["input_ids"])

    def apply_chat_template(
        self,
        messages: Sequence[dict],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        documents: Sequence[dict] | None = None,
        chat_template_kwargs: dict | None = None,
        sandbox: Callable[..., str] | None = None,
    ) -> str:
        """The conversation as text. A request's own `chat_template` renders through `sandbox`
        (gateway/text/template_sandbox.py) where one is given; the server's renders here."""
        if sandbox is not None and chat_template is not None and not self._named_template(chat_template):
            return sandbox(chat_template, list(messages), add_generation_prompt=add_generation_prompt,
                           continue_final_message=continue_final_message,
                           documents=list(documents) if documents is not None else None,
                           variables={**self.tokenizer.special_tokens_map, **(chat_template_kwargs or {})})
        template = chat_template or self.chat_template
        if template is None and getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError("this model's tokenizer has no chat template; pass chat_template=...")
        try:
            return self.tokenizer.apply_chat_template(
                list(messages),
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                chat_template=template,
                documents=list(documents) if documents is not None else None,
                **(chat_template_kwargs or {}),
            )
        except Exception as exc:  # jinja errors, missing keys: the caller's input
            raise ValueError(f"cannot apply the chat template: {exc}") from exc

    def _named_template(self, name: str) -> bool:
        """A name of one of the model's own templates (a tokenizer may hold several by name)."""
        return isinstance(self.tokenizer.chat_template, dict) and name in self.tokenizer.chat_template

    def encode_chat(self, messages: Sequence[dict], **kwargs) -> list[int]:
        return self.chat_prompt(messages, **kwargs)[1]

    def chat_prompt(self, messages: Sequence[dict], *, add_special_tokens: bool = False,
                    **kwargs) -> tuple[str, list[int]]:
        """The conversation rendered by the chat template once: its text and its token ids.
        The template places the special tokens it wants; `add_special_tokens` adds the
        tokenizer's own (a BOS) as well, for templates that leave them out."""
        text = self.apply_chat_template(messages, **kwargs)
        if self._content_as_text is not None and self._content_as_text.holds_special_text(messages):
            ids = self._content_as_text.encode(messages, text,
                                               lambda marked: self.apply_chat_template(marked, **kwargs))
            return text, (self.tokenizer.build_inputs_with_special_tokens(ids) if add_special_tokens else ids)
        return text, list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if self._backend is not None and len(token_ids) > LONG_DECODE_TOKENS:
            # The backend's batch decode lets go of the GIL while it runs (its single decode
            # does not), so a long decode on a thread leaves the event loop running.
            return self._backend.decode_batch([token_ids], skip_special_tokens=skip_special_tokens)[0]
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
