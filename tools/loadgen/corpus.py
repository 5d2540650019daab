"""Prompt text: prose from the standard library's docstrings, cut to token lengths.

The corpus is read from the standard library's source with `ast` (nothing is imported or
downloaded), in sorted file order, so one Python version always yields the same words.

A `Segment` of N tokens starts at a word offset and takes as many words as fit in N tokens of
the server's tokenizer (`POST /tokenize`). Without a tokenizer endpoint, segments are random
token ids of exactly N tokens, with corpus text of about N tokens for chat messages.
"""

from __future__ import annotations

import ast
import asyncio
import functools
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import httpx

CORPUS_WORDS = 50_000  # about 65k tokens; longer prompts wrap around
CALIBRATION_WORDS = 2_000
MAX_PROBES = 10
# A fitted segment may fall short of its length by 1 / LENGTH_SLACK of it (exact below that many
# tokens): the last few words of a long window would cost many more /tokenize calls.
LENGTH_SLACK = 100
# Used only without a tokenizer endpoint: a typical English BPE ratio, and an id range that is
# inside every common vocabulary and above the ids where special tokens live.
ESTIMATED_TOKENS_PER_WORD = 1.3
RANDOM_TOKEN_IDS = (1_000, 30_000)


@functools.lru_cache(maxsize=1)
def stdlib_words(limit: int = CORPUS_WORDS) -> tuple[str, ...]:
    """Words of the docstrings of the standard library's modules, classes and functions."""
    root = Path(sysconfig.get_paths()["stdlib"])
    words: list[str] = []
    seen: set[str] = set()
    for path in sorted(root.glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            doc = ast.get_docstring(node)
            if not doc or doc in seen:
                continue
            seen.add(doc)
            for line in doc.splitlines():
                stripped = line.strip()
                if not stripped.startswith((">>>", "...")):  # keep prose, drop doctest code
                    words.extend(stripped.split())
            if len(words) >= limit:
                return tuple(words[:limit])
    if not words:
        raise RuntimeError(f"no docstrings found under {root}")
    return tuple(words)


@dataclass(slots=True, frozen=True)
class Segment:
    """A piece of a prompt: its text, its token ids when it is made of ids, and its length."""

    text: str
    num_tokens: int
    token_ids: tuple[int, ...] | None = None


class TokenCounter:
    """Counts tokens with the server's `POST /tokenize` (vLLM and Spillway answer it)."""

    def __init__(self, http: httpx.AsyncClient, model: str | None, max_parallel: int = 8) -> None:
        self.http = http
        self.model = model
        self._limit = asyncio.Semaphore(max_parallel)

    async def count(self, text: str) -> int:
        body = {"prompt": text, "add_special_tokens": False}
        if self.model is not None:
            body["model"] = self.model
        async with self._limit:
            response = await self.http.post("/tokenize", json=body)
        response.raise_for_status()
        answer = response.json()
        return int(answer["count"]) if "count" in answer else len(answer["tokens"])


class TextPrompts:
    """Segments of corpus text whose token count, measured by the server, is at most the target.

    The largest word count that fits is searched for by interpolating between the longest
    window known to fit and the shortest known to exceed (regula falsi), starting from the
    calibrated tokens-per-word ratio; it stops after MAX_PROBES /tokenize calls at most,
    keeping the best fit found.
    """

    source = "corpus text measured by the server's /tokenize"

    def __init__(self, words: tuple[str, ...], counter: TokenCounter, tokens_per_word: float) -> None:
        self.words = words
        self.counter = counter
        self.tokens_per_word = tokens_per_word
        self._cache: dict[tuple[int, int, str], Segment] = {}
        self._lead_cache: dict[str, int] = {}

    @classmethod
    async def calibrate(cls, words: tuple[str, ...], counter: TokenCounter) -> TextPrompts:
        sample = " ".join(words[:CALIBRATION_WORDS])
        return cls(words, counter, max(await counter.count(sample), 1) / CALIBRATION_WORDS)

    def text(self, start: int, num_words: int, lead: str) -> str:
        n = len(self.words)
        body = " ".join(self.words[(start + i) % n] for i in range(num_words))
        return lead + body

    async def segment(self, start: int, num_tokens: int, lead: str = "") -> Segment:
        key = (start, num_tokens, lead)
        if key not in self._cache:
            self._cache[key] = await self._fit(start, num_tokens, lead)
        return self._cache[key]

    async def _fit(self, start: int, num_tokens: int, lead: str) -> Segment:
        lead_tokens = await self._lead_tokens(lead)
        if lead_tokens >= num_tokens:
            return Segment(lead, lead_tokens)
        fit = (0, lead_tokens)  # (words, tokens): the longest window known to fit
        over: tuple[int, int] | None = None  # the shortest window known to exceed the target
        guess = max(1, round((num_tokens - lead_tokens) / self.tokens_per_word))
        for _ in range(MAX_PROBES):
            count = await self.counter.count(self.text(start, guess, lead))
            if count <= num_tokens:
                fit = (guess, count)
            else:
                over = (guess, count)
            if num_tokens - fit[1] <= num_tokens // LENGTH_SLACK or (over is not None and over[0] - fit[0] <= 1):
                break
            guess = self._next_guess(fit, over, num_tokens)
        return Segment(self.text(start, fit[0], lead), fit[1])

    def _next_guess(self, fit: tuple[int, int], over: tuple[int, int] | None, num_tokens: int) -> int:
        """Interpolate between the bracket's ends (regula falsi), or extrapolate from the fit."""
        if over is None:
            words, tokens = fit
            return words + max(1, round((num_tokens - tokens) / self.tokens_per_word))
        slope = (over[1] - fit[1]) / (over[0] - fit[0])
        guess = fit[0] + round((num_tokens - fit[1]) / slope)
        return min(max(guess, fit[0] + 1), over[0] - 1)

    async def _lead_tokens(self, lead: str) -> int:
        if lead not in self._lead_cache:
            self._lead_cache[lead] = await self.counter.count(lead) if lead else 0
        return self._lead_cache[lead]


class RandomTokenPrompts:
    """Segments of random token ids (exact lengths), for servers without a tokenizer endpoint.

    Chat messages cannot carry ids, so they get corpus text of about the same length.
    """

    def __init__(self, words: tuple[str, ...], reason: str) -> None:
        self.words = words
        self.source = f"random token ids ({reason}); chat text lengths are estimates"

    async def segment(self, start: int, num_tokens: int, lead: str = "") -> Segment:
        rng = random.Random(f"{start}:{num_tokens}:{lead}")
        ids = tuple(rng.randrange(*RANDOM_TOKEN_IDS) for _ in range(num_tokens))
        num_words = max(1, round(num_tokens / ESTIMATED_TOKENS_PER_WORD))
        n = len(self.words)
        text = lead + " ".join(self.words[(start + i) % n] for i in range(num_words))
        return Segment(text, num_tokens, ids)


async def prompt_source(http: httpx.AsyncClient, model: str | None, words: tuple[str, ...]):
    """Text measured by the server's tokenizer when it has one, else random token ids."""
    counter = TokenCounter(http, model)
    try:
        return await TextPrompts.calibrate(words, counter)
    except httpx.HTTPStatusError as exc:
        return RandomTokenPrompts(words, f"/tokenize answered HTTP {exc.response.status_code}")
    except httpx.HTTPError as exc:
        return RandomTokenPrompts(words, f"/tokenize failed: {type(exc).__name__}")
    except (ValueError, KeyError, TypeError):
        return RandomTokenPrompts(words, "/tokenize answered without a token count")
