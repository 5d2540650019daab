"""Grammars of constrained requests (protocol `StructuredOutput`), compiled by xgrammar.

xgrammar was chosen by measurement against llguidance and outlines-core
(tools/bench/grammar/REPORT.md): the cheapest masks (about 5 µs a row a step), a compile cache
(a repeated schema costs ~0.2 ms), and regex, EBNF, Lark, structural tags and rollback.

    GrammarCompiler   the model's vocabulary as xgrammar sees it, compiles off the busy loop
                      (a thread pool; xgrammar caches by grammar), each within a time bound
    RequestGrammar    one request's matcher: the tokens allowed next as a bitmask row, the
                      committed tokens accepted, a walk through drafts rolled back

A bitmask row holds `ceil(vocab_size / 32)` int32 words, bit `t % 32` of word `t // 32` set
when token t may come next (worker/sample/token_masks.py applies it to the logits). The
vocabulary is the logits' width (`vocab_size` of the config), which may exceed the
tokenizer's: the ids past it are never allowed.
"""

from __future__ import annotations

import json
import logging
import re
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from spillway.protocol.local import model_files
from spillway.protocol.local.model_files import ModelFiles
from spillway.protocol.messages import StructuredKind, StructuredOutput

logger = logging.getLogger(__name__)

# Whitespace xgrammar lets a JSON answer put between two tokens, where it allows any: enough
# for indented JSON, not enough for a model to loop on spaces until max_tokens.
MAX_JSON_WHITESPACE = 16


class RequestGrammar:
    """One request's position in its grammar; the core (worker/core/step_commits.py) feeds it
    the answer's committed tokens through `accept`, the engine asks `fill` before each step."""

    def __init__(self, matcher) -> None:
        self._matcher = matcher

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Row `row` of `bitmask` (int32 on the host) set to the tokens allowed next; every
        token past the stop token (a verified position after a drafted stop, never used)."""
        if self._matcher.is_terminated():
            bitmask[row].fill_(-1)
        else:
            self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        """Advance by a committed token; False (and no change) where the grammar refuses it."""
        return self._matcher.accept_token(token_id)

    def is_terminated(self) -> bool:
        """The answer is complete and its stop token accepted."""
        return self._matcher.is_terminated()

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self._matcher.rollback(num_tokens)


class GrammarCompiler:
    """Compiles `StructuredOutput`s for one model's vocabulary.

    `submit` returns a Future of the compiled grammar (or of a ValueError naming the problem);
    `grammar` makes a request's matcher from one. The model folder's tokenizer and xgrammar
    are loaded by the first compile, in the compile thread (about 0.4 s, never on the busy
    loop); a folder without a tokenizer fails every compile, saying so."""

    def __init__(self, files: ModelFiles, vocab_size: int, stop_token_ids: list[int]) -> None:
        self.files, self.vocab_size, self.stop_token_ids = files, vocab_size, list(stop_token_ids)
        self._xgr = None
        self._compiler = None
        # One thread: compiles queue behind each other and never take more than one core from
        # the busy loop; xgrammar's cache makes a repeated grammar almost free.
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")

    def _load(self) -> None:
        if self._compiler is not None:
            return
        try:  # the gateway's tokenizer, loaded as it loads it
            tokenizer = model_files.load_tokenizer(self.files)
        except (OSError, ValueError) as error:
            raise ValueError(f"structured outputs need the model's tokenizer: {first_line(error)}") from None
        import xgrammar

        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
                                                       stop_token_ids=self.stop_token_ids or None)
        self._compiler = xgrammar.GrammarCompiler(info, cache_enabled=True)
        self._xgr = xgrammar

    def submit(self, structured: StructuredOutput) -> Future:
        return self._pool.submit(self.compile, structured)

    def compile(self, structured: StructuredOutput):
        """The compiled grammar; ValueError naming what the library refused."""
        self._load()
        compiler, kind, spec = self._compiler, structured.kind, structured.spec
        try:
            if kind in (StructuredKind.JSON, StructuredKind.JSON_OBJECT):
                # A schema is strict, as vLLM runs xgrammar: an object takes only the properties
                # its schema names, so a model cannot ramble on in extra keys; json_object is
                # any object, whatever its keys.
                json_object = kind is StructuredKind.JSON_OBJECT
                compact = structured.compact
                return compiler.compile_json_schema('{"type": "object"}' if json_object else spec,
                                                    any_whitespace=not compact, strict_mode=not json_object,
                                                    max_whitespace_cnt=None if compact else MAX_JSON_WHITESPACE)
            if kind is StructuredKind.REGEX:
                return compiler.compile_regex(spec)
            if kind is StructuredKind.CHOICE:
                return compiler.compile_grammar(choice_grammar(json.loads(spec)))
            if kind is StructuredKind.GRAMMAR:
                return self._compile_grammar_text(spec)
            if kind is StructuredKind.STRUCTURAL_TAG:
                return self._compile_structural_tag(spec)
        except (RuntimeError, ValueError, TypeError, KeyError) as error:
            raise ValueError(f"the {kind.value} constraint does not compile: {first_line(error)}") from None
        raise ValueError(f"unknown structured output kind {kind!r}")

    def _compile_grammar_text(self, text: str):
        """EBNF (GBNF, a `root` rule), or Lark (a `start` rule) where EBNF fails, as vLLM
        takes either; the EBNF error is the one reported."""
        try:
            return self._compiler.compile_grammar(text)
        except (RuntimeError, ValueError) as ebnf_error:
            try:
                return self._compiler.compile_lark(text)
            except (RuntimeError, ValueError, TypeError):
                raise ebnf_error from None

    def _compile_structural_tag(self, text: str):
        """xgrammar's structural tag JSON, or vLLM's older form (`structures` of begin, schema
        and end, and `triggers`)."""
        tag = json.loads(text)
        if isinstance(tag, dict) and "structures" in tag:
            items = [self._xgr.StructuralTagItem(begin=item["begin"], schema=json.dumps(item.get("schema", {})),
                                                 end=item["end"]) for item in tag["structures"]]
            return self._compiler.compile_structural_tag(items, tag.get("triggers", []))
        return self._compiler.compile_structural_tag(text)

    def grammar(self, compiled) -> RequestGrammar:
        """A new matcher at the start of `compiled` (what a finished `submit` gave)."""
        return RequestGrammar(self._xgr.GrammarMatcher(compiled))

    def allocate_bitmask(self, num_rows: int) -> torch.Tensor:
        """An int32 `[num_rows, ceil(vocab_size / 32)]` host buffer for `RequestGrammar.fill`."""
        return torch.full((num_rows, (self.vocab_size + 31) // 32), -1, dtype=torch.int32)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose language is exactly `choices`."""
    return "root ::= " + " | ".join(json.dumps(choice) for choice in choices)


def first_line(error: BaseException) -> str:
    """The first line of the library's message, without its `[time] source.cc:line: ` prefix."""
    text = str(error).strip()
    line = text.splitlines()[0] if text else type(error).__name__
    return re.sub(r"^\[[0-9:]+\] \S+:\d+: ", "", line)
