"""Prompts replayed from a file instead of drawn from the corpus: `--dataset FILE`.

Two formats, told apart by their content:

    ShareGPT JSON   a list of {"conversations": [{"from": "human", "value": ...},
                                                 {"from": "gpt", "value": ...}, ...]}
                    ("user"/"assistant" roles and a "messages" key with "role"/"content" too):
                    the first user turn is the prompt, the reply after it sets the output length
    JSON lines      one prompt per line: a JSON string, or {"prompt": ..., "output_len": N}
                    (output_len optional; "max_tokens" is read as well)

Items without a prompt (or, in ShareGPT, without a reply after it) are skipped, and the count
skipped is reported. Requests take the items in an order shuffled by `--seed`, starting over
when more requests than items are asked for. An output length the file does not give comes from
`--output-len`; a reply's length is measured with the server's tokenizer when it has one.
"""

from __future__ import annotations

import json
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from .corpus import ESTIMATED_TOKENS_PER_WORD, Segment, TextPrompts
from .workloads import Conversation, Lengths, Turn

USER_ROLES = ("human", "user")
REPLY_ROLES = ("gpt", "assistant", "model", "chatgpt", "bard")


@dataclass(slots=True, frozen=True)
class DatasetItem:
    prompt: str
    output_len: int | None = None  # tokens, when the file gives them
    reply: str | None = None  # the recorded reply, whose length sets the output length


@dataclass(slots=True, frozen=True)
class Dataset:
    path: str
    items: list[DatasetItem]
    num_skipped: int

    def describe(self) -> str:
        skipped = f", {self.num_skipped} skipped" if self.num_skipped else ""
        return f"dataset {Path(self.path).name}: {len(self.items)} prompts{skipped}"


def load_dataset(path: str) -> Dataset:
    """Read a ShareGPT JSON file or a JSON-lines file of prompts; ValueError when it is neither."""
    text = Path(path).read_text(encoding="utf-8")
    stripped = text.lstrip()
    if stripped.startswith("["):
        try:
            records = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON ({exc})") from None
        items = [_sharegpt_item(record) for record in records]
    else:
        items = []
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                items.append(_line_item(json.loads(line)))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}, line {number}: not valid JSON ({exc})") from None
    kept = [item for item in items if item is not None]
    if not kept:
        raise ValueError(f"{path}: no usable prompt (ShareGPT JSON or JSON lines of prompts expected)")
    return Dataset(path, kept, len(items) - len(kept))


def _sharegpt_item(record) -> DatasetItem | None:
    if not isinstance(record, dict):
        return None
    turns = record.get("conversations") or record.get("messages") or []
    pairs = [(turn.get("from", turn.get("role")), turn.get("value", turn.get("content")))
             for turn in turns if isinstance(turn, dict)]
    for (role, text), (next_role, reply) in zip(pairs, pairs[1:]):
        if role in USER_ROLES and next_role in REPLY_ROLES and isinstance(text, str) and text.strip() \
                and isinstance(reply, str) and reply.strip():
            return DatasetItem(text, reply=reply)
    return None


def _line_item(value) -> DatasetItem | None:
    if isinstance(value, str):
        return DatasetItem(value) if value.strip() else None
    if not isinstance(value, dict) or not isinstance(value.get("prompt"), str) or not value["prompt"].strip():
        return None
    length = value.get("output_len", value.get("max_tokens"))
    return DatasetItem(value["prompt"], int(length) if isinstance(length, int) and length > 0 else None)


async def _num_tokens(text: str, prompts) -> int:
    if isinstance(prompts, TextPrompts):
        return max(1, await prompts.counter.count(text))
    return max(1, round(len(text.split()) * ESTIMATED_TOKENS_PER_WORD))


async def dataset_conversations(dataset: Dataset, prompts, count: int | None, output_len: Lengths | None,
                                seed: int) -> AsyncIterator[Conversation]:
    """One single-turn conversation per request, items in a seeded order, cycling; endless
    when no count is given."""
    rng = random.Random(seed)
    order = list(range(len(dataset.items)))
    rng.shuffle(order)
    index = 0
    while count is None or index < count:
        item = dataset.items[order[index % len(order)]]
        if output_len is not None:
            length = output_len.draw(rng)
        elif item.output_len is not None:
            length = item.output_len
        elif item.reply is not None:
            length = await _num_tokens(item.reply, prompts)
        else:
            raise ValueError(f"{dataset.path}: a prompt without an output length; give --output-len")
        user = Segment(item.prompt, await _num_tokens(item.prompt, prompts))
        yield Conversation(index, None, [Turn(user, length)])
        index += 1
