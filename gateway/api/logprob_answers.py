"""Log-probabilities as OpenAI and vLLM answer them: chat's per-token entries with bytes,
completions' parallel lists, and vLLM's `prompt_logprobs` (None for the first prompt token,
then token id -> {logprob, rank, decoded_token}).

Tokens are named by their text, or "token_id:<id>" when the client asked
(`return_tokens_as_token_ids`) or the server has no tokenizer.
"""

from __future__ import annotations

from spillway.gateway.api import answers
from spillway.protocol.messages import TokenLogprobs


class TokenStrings:
    """Token id -> its text and its bytes, for logprobs."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._byte_level = backend is not None and type(backend.decoder).__name__ == "ByteLevel"
        self._byte_table = _byte_level_table() if self._byte_level else {}
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        entry = self._cache.get(token_id)
        if entry is None:
            if self.tokenizer is None:
                entry = token_id_string(token_id)
            else:
                text = self.tokenizer.decode([token_id], skip_special_tokens=False)
                raw = self.tokenizer.convert_ids_to_tokens(token_id) if self._byte_level else None
                if raw is not None and all(ch in self._byte_table for ch in raw):
                    entry = (text, [self._byte_table[ch] for ch in raw])
                else:
                    entry = (text, list(text.encode()))
            self._cache[token_id] = entry
        return entry


def token_id_string(token_id: int) -> tuple[str, list[int]]:
    """A token named by its id, as vLLM's return_tokens_as_token_ids names it."""
    text = f"token_id:{token_id}"
    return text, list(text.encode())


def _byte_level_table() -> dict[str, int]:
    """Byte-level BPE spells each byte as one printable character; this maps them back."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in printable}
    shifted = 0
    for b in range(256):
        if b not in table.values():
            table[chr(256 + shifted)] = b
            shifted += 1
    return table


def chat_logprobs(entries: list[TokenLogprobs], strings) -> answers.ChatLogprobs:
    content = []
    for entry in entries:
        text, raw = strings(entry.token_id)
        top = []
        for token_id, logprob in zip(entry.top_token_ids, entry.top_logprobs):
            top_text, top_raw = strings(token_id)
            top.append(answers.TopLogprob(top_text, logprob, top_raw))
        content.append(answers.ChatTokenLogprob(text, entry.logprob, raw, top))
    return answers.ChatLogprobs(content)


def completion_logprobs(entries: list[TokenLogprobs], strings, offset: int) -> answers.CompletionLogprobs:
    result = answers.CompletionLogprobs([], [], [], [])
    for entry in entries:
        text = strings(entry.token_id)[0]
        top = {strings(tid)[0]: lp for tid, lp in zip(entry.top_token_ids, entry.top_logprobs)}
        top.setdefault(text, entry.logprob)
        result.text_offset.append(offset)
        result.token_logprobs.append(entry.logprob)
        result.tokens.append(text)
        result.top_logprobs.append(top)
        offset += len(text)
    return result


def prompt_logprobs(entries: list[TokenLogprobs], strings) -> list[dict[str, answers.PromptLogprob] | None]:
    """vLLM's shape: the first prompt token has no logprob; each other one maps its own id and
    its most likely alternatives' ids to their logprob and rank."""
    result: list[dict[str, answers.PromptLogprob] | None] = [None]
    for entry in entries:
        ranked = {str(entry.token_id): answers.PromptLogprob(entry.logprob, entry.rank, strings(entry.token_id)[0])}
        for rank, (token_id, logprob) in enumerate(zip(entry.top_token_ids, entry.top_logprobs), start=1):
            ranked.setdefault(str(token_id), answers.PromptLogprob(logprob, rank, strings(token_id)[0]))
        result.append(ranked)
    return result
