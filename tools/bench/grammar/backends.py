"""The grammar libraries for constrained decoding on the CPU, side by side: xgrammar, llguidance and
outlines-core, each driven through its own API on one Hugging Face tokenizer.

    python tools/bench/grammar/backends.py                              # all three, SmolLM2's tokenizer
    python tools/bench/grammar/backends.py --libs xgrammar,llguidance --steps 200
    python tools/bench/grammar/backends.py --json /tmp/grammar.jsonl    # also one JSON line a row

Needs the libraries (`pip install xgrammar llguidance outlines-core`; a library that is missing is
skipped) and a tokenizer: --tokenizer DIR (a Hugging Face tokenizer folder), by default the
default model's (SmolLM2-135M-Instruct's, 49,152 tokens). Takes about 40 s on two cores.

Rows, each with the library and its version:
  setup    building the library's vocabulary from the HF tokenizer, once (import time beside it).
  compile  one grammar: the 50-property JSON schema (`large_schema`: strings, integers, numbers,
           booleans, enums, nested objects, arrays of objects, half of them required), a 3-property
           schema, an e-mail regex, a phone regex, a choice of 5 strings, and any JSON object.
           cold: the first compile in this process; repeat: the same grammar compiled again (only
           xgrammar caches: a hit); first mask: a new matcher from the compiled grammar and its
           first bitmask (llguidance builds its lexer lazily, so its first mask carries work the
           others do in compile); matcher: a new matcher alone (mean of 20).
  mask     a batch of matchers of the large schema (--batch, and 1), each row walking its own valid
           instance of the schema (`instance`, seed = row) token by token, looping back to the start
           when it ends. One step: fill the int32 bitmask [batch, ceil(vocab/32)] (a torch tensor on
           the CPU) for every row, then accept every row's next token; mean and p99 of a step, and the
           mean of its two parts. mode: serial (a Python loop over the rows) or parallel (the
           library's batched, multi-threaded call, where it has one). blocked: the document tokens
           that the mask forbade (must be 0).
  check    spot checks on the large schema: the first mask allows `{`, forbids a letter, allows
           whitespace or not; the document's end accepts EOS / terminates; a token of the wrong type
           is refused by the accept call; the three libraries' first masks of the choice grammar agree.
  feature  what works, probed by calling the API: a valid document must be accepted and an invalid
           one refused ("ignored" = compiles but lets the invalid one through; "no API" = nothing to
           call). JSON-schema keywords, regex, choice, EBNF/GBNF and Lark grammars, structural tags
           (a tool-call tag that switches from free text to a JSON schema), rollback of accepted
           tokens, jump-forward (forced) text.
  apply    masking [batch, vocab] fp32 logits on the CPU with a filled bitmask (one layout for all three
           libraries: bit i of word j allows token 32*j+i).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

LIBS = ("xgrammar", "llguidance", "outlines_core")

# ---------------------------------------------------------------------------------------------
# The grammars and their documents (no library needed: the test imports these).

WORDS = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet", "kilo",
         "lima", "mike", "november", "oscar", "papa", "quebec", "romeo", "sierra", "tango", "Zürich", "naïve"]
KINDS = ["string", "integer", "number", "boolean", "enum", "object", "array_of_objects", "short_string",
         "array_of_strings", "nested_object"]
NAMES = ["title", "count", "score", "active", "status", "address", "items", "code", "tags", "owner"]
EMAIL_REGEX = r"[a-z0-9._%+-]+@[a-z0-9.-]+\.[a-z]{2,6}"
PHONE_REGEX = r"\+1 \([0-9]{3}\) [0-9]{3}-[0-9]{4}"
CHOICES = ["positive", "negative", "neutral", "mixed", "unknown"]


def property_schema(kind: str) -> dict:
    """The schema of one of the large schema's properties."""
    if kind == "string":
        return {"type": "string", "maxLength": 48}
    if kind == "integer":
        return {"type": "integer", "minimum": 0, "maximum": 100000}
    if kind == "number":
        return {"type": "number"}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"type": "string", "enum": ["pending", "active", "suspended", "closed"]}
    if kind == "object":
        return {"type": "object", "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                                                 "zip": {"type": "string"}},
                "required": ["street", "city", "zip"], "additionalProperties": False}
    if kind == "array_of_objects":
        return {"type": "array", "minItems": 1, "maxItems": 3,
                "items": {"type": "object", "properties": {"sku": {"type": "string"}, "qty": {"type": "integer"}},
                          "required": ["sku", "qty"], "additionalProperties": False}}
    if kind == "short_string":
        return {"type": "string", "minLength": 2, "maxLength": 12}
    if kind == "array_of_strings":
        return {"type": "array", "items": {"type": "string"}, "maxItems": 4}
    if kind == "nested_object":
        return {"type": "object", "properties": {
            "name": {"type": "string"}, "id": {"type": "integer"},
            "contact": {"type": "object", "properties": {"email": {"type": "string"}, "verified": {"type": "boolean"}},
                        "required": ["email", "verified"], "additionalProperties": False}},
            "required": ["name", "id", "contact"], "additionalProperties": False}
    raise ValueError(f"unknown kind {kind!r}")


def large_schema() -> dict:
    """50 properties of mixed types, the even-numbered ones required, no others allowed."""
    props, required = {}, []
    for i in range(50):
        name = f"{NAMES[i % 10]}_{i}"
        props[name] = property_schema(KINDS[i % 10])
        if i % 2 == 0:
            required.append(name)
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def small_schema() -> dict:
    return {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                             "member": {"type": "boolean"}},
            "required": ["name", "age", "member"], "additionalProperties": False}


def instance(schema: dict, rng: random.Random, optional_p: float = 0.7):
    """A valid instance of `schema` (the subset of JSON schema the large schema uses); an object's
    optional properties are each present with probability `optional_p`, in the schema's order."""
    if "enum" in schema:
        return rng.choice(schema["enum"])
    kind = schema["type"]
    if kind == "object":
        required = set(schema.get("required", ()))
        return {name: instance(sub, rng, optional_p) for name, sub in schema["properties"].items()
                if name in required or rng.random() < optional_p}
    if kind == "array":
        low, high = schema.get("minItems", 0), schema.get("maxItems", 3)
        return [instance(schema["items"], rng, optional_p) for _ in range(rng.randint(low, high))]
    if kind == "string":
        low, high = schema.get("minLength", 0), schema.get("maxLength", 40)
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 4)))
        if rng.random() < 0.2 and "minLength" not in schema and "maxLength" not in schema:
            text += ' "quoted"'  # an escape (not where a length bound is: xgrammar 0.2.9 refuses those)
        text = text[:high]
        while len(text) < low:
            text += rng.choice("xyz")
        return text
    if kind == "integer":
        return rng.randint(schema.get("minimum", -1000), schema.get("maximum", 1000))
    if kind == "number":
        return round(rng.uniform(-1000, 1000), rng.randint(1, 3))
    if kind == "boolean":
        return rng.random() < 0.5
    raise ValueError(f"no instances of {schema}")


def document(seed: int) -> str:
    """One valid instance of the large schema as JSON text, with ", " and ": " separators."""
    return json.dumps(instance(large_schema(), random.Random(seed)), ensure_ascii=False)


def grammar_cases() -> dict[str, tuple[str, object]]:
    """The compile table's grammars: name -> (kind, spec)."""
    return {"json_large": ("json_schema", large_schema()), "json_small": ("json_schema", small_schema()),
            "regex_email": ("regex", EMAIL_REGEX), "regex_phone": ("regex", PHONE_REGEX),
            "choice_5": ("choice", CHOICES), "json_object": ("json_object", None)}


def keyword_probes() -> dict[str, tuple[dict, list[str], list[str]]]:
    """JSON-schema keyword -> (schema of property "x", valid values, invalid values), as JSON text."""
    defs = {"point": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
                      "additionalProperties": False}}
    return {
        "enum": ({"type": "string", "enum": ["red", "green"]}, ['"red"'], ['"blue"']),
        "const": ({"const": "fixed"}, ['"fixed"'], ['"other"']),
        "anyOf": ({"anyOf": [{"type": "integer"}, {"type": "string", "enum": ["none"]}]}, ["5", '"none"'],
                  ["true", '"other"']),
        "$ref/$defs": ({"$ref": "#/$defs/point"}, ['{"a": 1}'], ['{"a": "s"}']),
        "pattern": ({"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}, ['"ABC-12"'], ['"abc-12"']),
        "minItems/maxItems": ({"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 3},
                              ["[1, 2]", "[1, 2, 3]"], ["[1]", "[1, 2, 3, 4]"]),
        "minLength/maxLength": ({"type": "string", "minLength": 3, "maxLength": 5}, ['"abcd"'],
                                ['"ab"', '"abcdef"']),
        "minLength/maxLength with escapes, non-ASCII": ({"type": "string", "maxLength": 5},
                                                        ['"a\\"b"', '"a\\\\b"', '"\u00e9\u00e9\u00e9\u00e9\u00e9"'],
                                                        ['"abcdef"']),
        "minimum/maximum": ({"type": "integer", "minimum": 0, "maximum": 10}, ["7"], ["50", "-1"]),
        "format: email": ({"type": "string", "format": "email"}, ['"a.b@example.com"'], ['"not an email"']),
        "format: date-time": ({"type": "string", "format": "date-time"}, ['"2024-01-02T03:04:05Z"'],
                              ['"yesterday"']),
        "format: uuid": ({"type": "string", "format": "uuid"}, ['"123e4567-e89b-12d3-a456-426614174000"'],
                         ['"not-a-uuid"']),
    }, defs


def keyword_schema(sub: dict, defs: dict) -> dict:
    return {"type": "object", "properties": {"x": sub}, "required": ["x"], "additionalProperties": False,
            "$defs": defs}


TOOL_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
               "additionalProperties": False}
TOOL_OK = 'Let me check. <function=get_weather>{"city": "Paris"}</function> Done.'
TOOL_BAD = 'Let me check. <function=get_weather>{"town": 1}</function> Done.'
EBNF = 'root ::= "(" num ("+" num)* ")"\nnum ::= [0-9]+\n'
LARK = 'start: "(" NUM ("+" NUM)* ")"\nNUM: /[0-9]+/\n'


# ---------------------------------------------------------------------------------------------
# One adapter a library: the calls an engine would make.

class Unsupported(Exception):
    """The library has no API for this."""


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: the printable character that stands for each byte."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs, extra = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


class XGrammar:
    name = "xgrammar"

    def __init__(self, threads: int) -> None:
        import xgrammar

        self.xgr, self.threads, self.version = xgrammar, threads, _dist_version("xgrammar")

    def setup(self, tok) -> None:
        xgr = self.xgr
        self.eos = tok.eos_token_id
        self.info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok))
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=self.threads, cache_enabled=True)
        self.batcher = xgr.BatchGrammarMatcher(max_threads=self.threads)

    def compile(self, kind: str, spec):
        c = self.compiler
        if kind == "json_schema":
            return c.compile_json_schema(json.dumps(spec))  # any_whitespace=True, strict_mode=True (defaults)
        if kind == "regex":
            return c.compile_regex(spec)
        if kind == "choice":  # no choice API: an EBNF alternation
            return c.compile_grammar("root ::= " + " | ".join(json.dumps(s) for s in spec))
        if kind == "json_object":
            return c.compile_builtin_json_grammar()
        if kind == "ebnf":
            return c.compile_grammar(spec)
        if kind == "lark":
            return c.compile_lark(spec)
        if kind == "structural_tag":
            st = self.xgr.StructuralTag(format=self.xgr.structural_tag.TriggeredTagsFormat(
                triggers=["<function="], tags=[self.xgr.structural_tag.TagFormat(
                    begin="<function=get_weather>",
                    content=self.xgr.structural_tag.JSONSchemaFormat(json_schema=TOOL_SCHEMA), end="</function>")]))
            return c.compile_structural_tag(st)
        raise Unsupported(kind)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, m, bitmask, row: int) -> None:
        m.fill_next_token_bitmask(bitmask, row)

    def fill_batch(self, ms, bitmask) -> None:
        self.batcher.batch_fill_next_token_bitmask(ms, bitmask)

    def accept(self, m, token: int) -> bool:
        return m.accept_token(token)

    def accept_batch(self, ms, tokens) -> list[bool]:
        return self.xgr.BatchGrammarMatcher.batch_accept_token(ms, tokens)

    def finish(self, m) -> bool:
        """Whether the matcher takes EOS here and is then terminated."""
        return m.accept_token(self.eos) and m.is_terminated()

    def reset(self, m) -> None:
        m.reset()

    def rollback(self, m, n: int) -> None:
        m.rollback(n)

    def forced(self, m) -> str:
        return m.find_jump_forward_string()


class LLGuidance:
    name = "llguidance"

    def __init__(self, threads: int) -> None:
        import llguidance
        import llguidance.hf  # not llguidance.torch: its import torch.compile's a kernel (2.6 s)

        self.llg, self.threads, self.version = llguidance, threads, llguidance.__version__

    def setup(self, tok) -> None:
        self.eos = tok.eos_token_id
        self.tok = self.llg.hf.from_tokenizer(tok)
        self.executor = self.llg.LLExecutor(num_threads=self.threads)

    def grammar(self, kind: str, spec) -> str:
        M = self.llg.LLMatcher
        if kind == "json_schema":
            return M.grammar_from_json_schema(json.dumps(spec))
        if kind == "regex":
            return M.grammar_from_regex(spec)
        if kind == "choice":
            return self.llg.grammar_from("choice", json.dumps(spec))
        if kind == "json_object":
            return M.grammar_from_json_schema(json.dumps({"type": "object"}))
        if kind == "ebnf":
            return self.llg.grammar_from("gbnf", spec)
        if kind == "lark":
            return M.grammar_from_lark(spec)
        if kind == "structural_tag":
            return self.llg.StructTag.to_grammar([self.llg.StructTag(
                trigger="<function=", begin="<function=get_weather>", grammar=TOOL_SCHEMA, end="</function>")])
        raise Unsupported(kind)

    def compile(self, kind: str, spec):
        """A prototype matcher: llguidance has no compiled-grammar object; new matchers are its deep copies."""
        proto = self.llg.LLMatcher(self.tok, self.grammar(kind, spec), log_level=0)
        if proto.is_error():
            raise ValueError(proto.get_error().splitlines()[0])
        return proto

    def matcher(self, compiled):
        return compiled.deep_copy()

    def fill(self, m, bitmask, row: int) -> None:  # = llguidance.torch.fill_next_token_bitmask(m, bitmask, row)
        target = bitmask[row]
        m.unsafe_compute_mask_ptr(target.data_ptr(), target.numel() * target.element_size())

    def fill_batch(self, ms, bitmask) -> None:  # = llguidance.torch.fill_next_token_bitmask_par(...)
        self.executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(ms)], bitmask.data_ptr(),
                                              bitmask.shape[1] * bitmask.element_size(), bitmask.shape[0])

    def accept(self, m, token: int) -> bool:
        return m.consume_token(token)  # a refused token leaves the matcher in its error state for good

    def accept_batch(self, ms, tokens) -> list[bool]:
        return self.executor.consume_token_par(list(zip(ms, tokens)))

    def finish(self, m) -> bool:
        return m.is_accepting() and m.consume_token(self.eos) and m.is_stopped() and not m.is_error()

    def reset(self, m) -> None:
        m.reset()

    def rollback(self, m, n: int) -> None:
        if not m.rollback(n):
            raise RuntimeError(m.get_error() or "rollback refused")

    def forced(self, m) -> str:
        return m.compute_ff_bytes().decode("utf-8", "replace")


class OutlinesCore:
    name = "outlines_core"

    def __init__(self, threads: int) -> None:
        import outlines_core

        self.oc, self.version = outlines_core, _dist_version("outlines_core")

    def setup(self, tok) -> None:
        """Vocabulary(eos, {token bytes: [ids]}): its from_pretrained downloads from the Hub, so the
        byte-level tokens are decoded to their bytes here; special tokens and EOS are left out."""
        self.eos = tok.eos_token_id
        char_to_byte = {c: b for b, c in bytes_to_unicode().items()}
        special, vocab = set(tok.all_special_ids), {}
        for text, token in tok.get_vocab().items():
            if token not in special:
                vocab.setdefault(bytes(char_to_byte[c] for c in text), []).append(token)
        self.vocab = self.oc.Vocabulary(self.eos, vocab)

    def regex(self, kind: str, spec) -> str:
        if kind == "json_schema":
            return self.oc.json_schema.build_regex_from_schema(json.dumps(spec))
        if kind == "regex":
            return spec
        if kind == "choice":
            return "(" + "|".join(escape_regex(s) for s in spec) + ")"
        if kind == "json_object":
            return self.oc.json_schema.build_regex_from_schema(json.dumps({"type": "object"}))
        raise Unsupported(kind)

    def compile(self, kind: str, spec):
        return self.oc.Index(self.regex(kind, spec), self.vocab)

    def matcher(self, compiled):
        return self.oc.Guide(compiled, max_rollback=32)

    def fill(self, m, bitmask, row: int) -> None:
        target = bitmask[row]
        m.write_mask_into(target.data_ptr(), target.numel(), target.element_size())

    fill_batch = None  # no batched call

    def accept(self, m, token: int) -> bool:
        try:
            m.advance(token, return_tokens=False)
            return True
        except ValueError:  # a refused token raises; the guide's state is unchanged
            return False

    accept_batch = None

    def finish(self, m) -> bool:
        """advance(EOS) raises even in a final state: the end is is_finished() with EOS in the mask."""
        return m.is_finished() and self.eos in m.get_tokens()

    def reset(self, m) -> None:
        m.reset()

    def rollback(self, m, n: int) -> None:
        m.rollback_state(n)

    def forced(self, m) -> str:
        raise Unsupported("jump-forward")


ADAPTERS = {"xgrammar": XGrammar, "llguidance": LLGuidance, "outlines_core": OutlinesCore}


def escape_regex(text: str) -> str:
    return "".join("\\" + c if c in r".^$*+?()[]{}|\/-" else c for c in text)


def _dist_version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


# ---------------------------------------------------------------------------------------------
# Measurements.

def allowed(bitmask, row: int, token: int) -> bool:
    return bool((int(bitmask[row, token >> 5]) >> (token & 31)) & 1)


def allowed_set(bitmask, row: int, vocab: int) -> set[int]:
    import torch

    bits = (bitmask[row].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return set(torch.nonzero(bits.flatten()[:vocab]).flatten().tolist())


def new_bitmask(batch: int, vocab: int):
    import torch

    return torch.full((batch, (vocab + 31) // 32), -1, dtype=torch.int32)


def ms_since(start: float) -> float:
    return 1e3 * (time.perf_counter() - start)


def compile_rows(lib, vocab: int) -> tuple[list[dict], dict]:
    rows, compiled = [], {}
    for case, (kind, spec) in grammar_cases().items():
        try:
            start = time.perf_counter()
            grammar = lib.compile(kind, spec)
            cold = ms_since(start)
            start = time.perf_counter()
            lib.compile(kind, spec)
            repeat = ms_since(start)
            bitmask = new_bitmask(1, vocab)
            start = time.perf_counter()
            lib.fill(lib.matcher(grammar), bitmask, 0)
            first = ms_since(start)
            start = time.perf_counter()
            for _ in range(20):
                lib.matcher(grammar)
            matcher_us = 1e3 * ms_since(start) / 20
        except Unsupported as e:
            rows.append(dict(grammar=case, error=f"no API: {e}"))
            continue
        except Exception as e:  # a compile error is a result here
            rows.append(dict(grammar=case, error=f"{type(e).__name__}: {str(e)[:120]}"))
            continue
        compiled[case] = grammar
        rows.append(dict(grammar=case, cold_ms=cold, repeat_ms=repeat, first_mask_ms=first, matcher_us=matcher_us))
    return rows, compiled


def mask_row(lib, compiled, docs: list[list[int]], batch: int, steps: int, mode: str, vocab: int) -> dict:
    """Walk `batch` matchers (row i on docs[i % len(docs)]) for `steps` steps; time fill + accept."""
    import numpy as np

    matchers = [lib.matcher(compiled) for _ in range(batch)]
    rows_docs = [docs[i % len(docs)] for i in range(batch)]
    pos = [0] * batch
    bitmask = new_bitmask(batch, vocab)
    fill_ns, accept_ns, blocked, refused = [], [], 0, 0
    for _ in range(steps):
        tokens = [rows_docs[i][pos[i]] for i in range(batch)]
        t0 = time.perf_counter_ns()
        if mode == "parallel":
            lib.fill_batch(matchers, bitmask)
        else:
            for i, m in enumerate(matchers):
                lib.fill(m, bitmask, i)
        t1 = time.perf_counter_ns()
        if mode == "parallel":
            ok = lib.accept_batch(matchers, tokens)
        else:
            ok = [lib.accept(m, t) for m, t in zip(matchers, tokens)]
        t2 = time.perf_counter_ns()
        fill_ns.append(t1 - t0)
        accept_ns.append(t2 - t1)
        rows = np.arange(batch)
        toks = np.asarray(tokens)
        words = bitmask.numpy()[rows, toks >> 5]
        blocked += int(np.sum(((words >> (toks & 31)) & 1) == 0))
        refused += batch - sum(bool(x) for x in ok)
        for i in range(batch):  # untimed: a row at the end of its document starts it again
            pos[i] += 1
            if pos[i] == len(rows_docs[i]):
                lib.reset(matchers[i])
                pos[i] = 0
    fill, accept = np.asarray(fill_ns) / 1e3, np.asarray(accept_ns) / 1e3
    step = fill + accept
    return dict(batch=batch, mode=mode, steps=steps, fill_mean_us=float(fill.mean()),
                accept_mean_us=float(accept.mean()), step_mean_us=float(step.mean()),
                step_p99_us=float(np.percentile(step, 99)), per_row_us=float(step.mean()) / batch,
                blocked=blocked, refused=refused)


def token_of(tok, text: str) -> int:
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) == 1, (text, ids)
    return ids[0]


def walk(lib, compiled, tokens: list[int]) -> tuple[object, int]:
    """A new matcher fed `tokens`: (matcher, how many it accepted before the first refusal)."""
    m = lib.matcher(compiled)
    for n, t in enumerate(tokens):
        if not lib.accept(m, t):
            return m, n
    return m, len(tokens)


def accepts(lib, compiled, tok, text: str) -> bool:
    tokens = tok.encode(text, add_special_tokens=False)
    m, n = walk(lib, compiled, tokens)
    return n == len(tokens) and lib.finish(m)


def check_rows(lib, compiled, tok, vocab: int) -> list[dict]:
    out = []

    def add(check: str, result) -> None:
        out.append(dict(check=check, result=result))

    large = compiled["json_large"]
    bitmask = new_bitmask(1, vocab)
    m = lib.matcher(large)
    lib.fill(m, bitmask, 0)
    n_allowed = len(allowed_set(bitmask, 0, vocab))
    add("start: allowed tokens", n_allowed)
    add("start: `{` allowed", allowed(bitmask, 0, token_of(tok, "{")))
    add("start: `a` forbidden", not allowed(bitmask, 0, token_of(tok, "a")))
    add("start: ` ` / `\\n` allowed", f"{allowed(bitmask, 0, token_of(tok, ' '))} / "
                                       f"{allowed(bitmask, 0, token_of(tok, chr(10)))}")
    doc = tok.encode(document(0), add_special_tokens=False)
    m, n = walk(lib, large, doc)
    add(f"document 0 ({len(doc)} tokens) accepted", n == len(doc))
    bitmask = new_bitmask(1, vocab)
    lib.fill(m, bitmask, 0)
    at_end = sorted(allowed_set(bitmask, 0, vocab))
    add("after the document: the mask allows", at_end if len(at_end) <= 5 else f"{len(at_end)} tokens")
    add("after the document: EOS accepted, terminated", n == len(doc) and lib.finish(m))
    bad = tok.encode('{"title_0": 5', add_special_tokens=False)
    m, n = walk(lib, large, bad)
    add('`{"title_0": 5` (a number for a string): refused at its last token', n == len(bad) - 1)
    m = lib.matcher(large)
    add("start: accept(`a`) refused", not lib.accept(m, token_of(tok, "a")))
    after = "-"
    if lib.name == "llguidance":
        after = f"is_error()={m.is_error()}, rollback(1)={m.rollback(1)}"
    elif lib.name == "xgrammar":
        after = f"still usable: accept(`{{`)={m.accept_token(token_of(tok, '{'))}"
    else:
        after = f"still usable: accept(`{{`)={lib.accept(m, token_of(tok, '{'))}"
    add("after a refused token", after)
    if "choice_5" in compiled:
        bitmask = new_bitmask(1, vocab)
        lib.fill(lib.matcher(compiled["choice_5"]), bitmask, 0)
        out.append(dict(check="choice_5 first mask", result=len(allowed_set(bitmask, 0, vocab)),
                        _set=sorted(allowed_set(bitmask, 0, vocab))))
    return out


def probe(lib, tok, kind: str, spec, valid: list[str], invalid: list[str]) -> str:
    try:
        compiled = lib.compile(kind, spec)
    except Unsupported:
        return "no API"
    except Exception as e:
        return f"error: {type(e).__name__}: {str(e).splitlines()[0][:80]}"
    bad_valid = [v for v in valid if not accepts(lib, compiled, tok, v)]
    if bad_valid:
        return f"refuses valid {bad_valid[0]!r}"
    let_through = [v for v in invalid if accepts(lib, compiled, tok, v)]
    if let_through:
        return f"ignored (accepts {let_through[0]!r})" if len(let_through) == len(invalid) else \
            f"partly (accepts {let_through[0]!r})"
    return "yes"


def feature_rows(lib, tok, vocab: int) -> list[dict]:
    out = []

    def add(feature: str, result: str) -> None:
        out.append(dict(feature=feature, result=result))

    probes, defs = keyword_probes()
    for keyword, (sub, valid, invalid) in probes.items():
        add(f"json: {keyword}", probe(lib, tok, "json_schema", keyword_schema(sub, defs),
                                      ['{"x": %s}' % v for v in valid], ['{"x": %s}' % v for v in invalid]))
    add("json: additionalProperties unset -> extra key",
        "allowed" if probe(lib, tok, "json_schema", {"type": "object", "properties": {"a": {"type": "integer"}}},
                           ['{"a": 1, "b": 2}'], []) == "yes" else "refused")
    add("json: pretty-printed document (newlines, indent 2)",
        "allowed" if probe(lib, tok, "json_schema", small_schema(),
                           [json.dumps({"name": "a", "age": 1, "member": True}, indent=2)], []) == "yes" else "refused")
    add("json: properties out of schema order",
        "allowed" if probe(lib, tok, "json_schema", {"type": "object", "properties": {
            "a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]},
            ['{"b": 2, "a": 1}'], []) == "yes" else "refused")
    add("regex (e-mail)", probe(lib, tok, "regex", EMAIL_REGEX, ["john.doe@example.com"], ["john@", "a b@c.de"]))
    add("regex (phone)", probe(lib, tok, "regex", PHONE_REGEX, ["+1 (555) 123-4567"], ["555-1234"]))
    add("choice", probe(lib, tok, "choice", CHOICES, ["neutral", "mixed"], ["neutr", "good"]))
    add("EBNF/GBNF", probe(lib, tok, "ebnf", EBNF, ["(1+22+3)"], ["(1+)", "1+2"]))
    add("Lark", probe(lib, tok, "lark", LARK, ["(1+22+3)"], ["(1+)", "1+2"]))
    add("structural tag (tool call in free text)", probe(lib, tok, "structural_tag", None, [TOOL_OK, "No tools."],
                                                         [TOOL_BAD]))
    add("rollback", probe_rollback(lib, tok, vocab))
    add("jump-forward", probe_forced(lib, tok))
    return out


def probe_rollback(lib, tok, vocab: int) -> str:
    """Accept 10 tokens, take the mask, accept 5 more, roll back 5: the mask must be the same, and the
    document must then still finish."""
    try:
        compiled = lib.compile("json_schema", large_schema())
        doc = tok.encode(document(1), add_special_tokens=False)
        m = lib.matcher(compiled)
        before, after = new_bitmask(1, vocab), new_bitmask(1, vocab)
        for t in doc[:10]:
            assert lib.accept(m, t)
        lib.fill(m, before, 0)
        for t in doc[10:15]:
            assert lib.accept(m, t)
        lib.rollback(m, 5)
        lib.fill(m, after, 0)
        if not bool((before == after).all()):
            return "mask differs after rollback"
        if not all(lib.accept(m, t) for t in doc[10:]) or not lib.finish(m):
            return "document fails after rollback"
        return "yes"
    except Unsupported:
        return "no API"
    except Exception as e:
        return f"error: {type(e).__name__}: {str(e)[:80]}"


def probe_forced(lib, tok) -> str:
    """The forced text at the start of {"name", "age", "member"} (all required), after `{"`, and in
    the choice grammar after `neg`."""
    try:
        compiled = lib.compile("json_schema", small_schema())
        m = lib.matcher(compiled)
        first = lib.forced(m)
        lib.accept(m, token_of(tok, '{"'))
        second = lib.forced(m)
        compiled = lib.compile("choice", CHOICES)
        m = lib.matcher(compiled)
        lib.accept(m, tok.encode("neg", add_special_tokens=False)[0])
        third = lib.forced(m)
        return f"yes: start {first!r}, after '{{\"' {second!r}, choice after 'neg' {third!r}"
    except Unsupported:
        return "no API"
    except Exception as e:
        return f"error: {type(e).__name__}: {str(e)[:80]}"


def apply_rows(batch: int, vocab: int, xgrammar_ok: bool, compiled_kernel: bool) -> list[dict]:
    """Masking fp32 logits [batch, vocab] with a half-full bitmask, microseconds a call (median of 20)."""
    import statistics

    import torch

    torch.manual_seed(0)
    logits = torch.randn(batch, vocab)
    bitmask = torch.randint(-2**31, 2**31 - 1, (batch, (vocab + 31) // 32), dtype=torch.int32)
    shifts = torch.arange(32, dtype=torch.int32)

    def plain(lg, bm):  # torch only, no compile
        allowed_bits = ((bm.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, :lg.shape[1]]
        lg.masked_fill_(~allowed_bits, float("-inf"))

    ways = {"torch (unpack + masked_fill_)": plain}
    if xgrammar_ok:
        import xgrammar

        ways["xgrammar apply_token_bitmask_inplace cpu"] = lambda lg, bm: xgrammar.apply_token_bitmask_inplace(
            lg, bm, backend="cpu")
        ways["xgrammar apply_token_bitmask_inplace torch_native"] = (
            lambda lg, bm: xgrammar.apply_token_bitmask_inplace(lg, bm, backend="torch_native"))
    if compiled_kernel:
        import llguidance.torch

        ways["llguidance.torch apply_token_bitmask_inplace (torch.compile)"] = (
            llguidance.torch.apply_token_bitmask_inplace)
    reference = logits.clone()
    plain(reference, bitmask)
    rows = []
    for name, fn in ways.items():
        start = time.perf_counter()
        first = logits.clone()
        fn(first, bitmask)
        first_ms = ms_since(start)
        times = []
        for _ in range(20):
            lg = logits.clone()
            start = time.perf_counter_ns()
            fn(lg, bitmask)
            times.append((time.perf_counter_ns() - start) / 1e3)
        rows.append(dict(way=name, batch=batch, vocab=vocab, us=statistics.median(times), first_ms=first_ms,
                         same=bool(torch.equal(first, reference))))
    return rows


# ---------------------------------------------------------------------------------------------

def parse_libs(text: str) -> list[str]:
    libs = [name.replace("-", "_") for name in text.split(",")]
    unknown = [name for name in libs if name not in LIBS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown libraries {unknown}; known: {', '.join(LIBS)}")
    return libs


def default_tokenizer():
    """The default model's tokenizer (SmolLM2-135M-Instruct's, from its GGUF file)."""
    from spillway.protocol.local import model_files

    return model_files.load_tokenizer(model_files.resolve_model(None))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--libs", type=parse_libs, default=list(LIBS), help=f"comma-separated, of {', '.join(LIBS)}")
    parser.add_argument("--tokenizer", help="a Hugging Face tokenizer folder (default: the default model's)")
    parser.add_argument("--batch", type=int, default=64, help="rows of the batched mask rows (default 64)")
    parser.add_argument("--steps", type=int, default=0,
                        help="steps of a mask row (default: the longest row document's tokens)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="threads for the libraries' parallel calls and xgrammar's compiler (default: CPUs)")
    parser.add_argument("--compiled-apply", action="store_true",
                        help="also time llguidance's torch.compile'd apply kernel (about 20 s to compile)")
    parser.add_argument("--json", help="append each row to this file as a JSON line")
    args = parser.parse_args()

    import torch  # noqa: F401  (imported first, so no library's import time includes torch's)
    from transformers import AutoTokenizer

    from spillway.tools.bench.ceilings import machine

    where = machine()
    print(where)
    tok = AutoTokenizer.from_pretrained(args.tokenizer) if args.tokenizer else default_tokenizer()
    vocab = len(tok)
    docs = [tok.encode(document(seed), add_special_tokens=False) for seed in range(args.batch)]
    steps = args.steps or max(len(d) for d in docs)
    print(f"tokenizer {args.tokenizer or 'of the default model'}: {vocab} tokens; {args.batch} documents of "
          f"{min(map(len, docs))}-{max(map(len, docs))} tokens; {steps} steps a mask row; {args.threads} threads")

    def emit(section: str, lib, row: dict) -> None:
        row = {"section": section, "lib": lib.name if lib else "-", "version": lib.version if lib else "-", **row}
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps({k: v for k, v in row.items() if not k.startswith("_")}
                                   | {"machine": where, "command": " ".join(sys.argv)}) + "\n")
        return row

    results: dict[str, dict] = {}
    for name in args.libs:
        start = time.perf_counter()
        try:
            lib = ADAPTERS[name](args.threads)
        except ImportError as e:
            print(f"\n== {name}: not installed ({e}); skipped")
            continue
        import_ms = ms_since(start)
        print(f"\n== {name} {lib.version}")
        start = time.perf_counter()
        lib.setup(tok)
        row = emit("setup", lib, dict(tokenizer_ms=ms_since(start), import_ms=import_ms))
        print(f"setup: tokenizer {row['tokenizer_ms']:.0f} ms (import {row['import_ms']:.0f} ms)")
        print(f"{'compile':>12} {'cold ms':>9} {'repeat ms':>10} {'1st mask ms':>12} {'matcher us':>11}")
        rows, compiled = compile_rows(lib, vocab)
        for row in rows:
            emit("compile", lib, row)
            if "error" in row:
                print(f"{row['grammar']:>12} {row['error']}")
            else:
                print(f"{row['grammar']:>12} {row['cold_ms']:9.2f} {row['repeat_ms']:10.3f} "
                      f"{row['first_mask_ms']:12.3f} {row['matcher_us']:11.1f}")
        checks = check_rows(lib, compiled, tok, vocab)
        for row in checks:
            emit("check", lib, row)
            print(f"check: {row['check']}: {row['result']}")
        masks = []
        if "json_large" in compiled:
            print(f"{'batch':>5} {'mode':>9} {'steps':>6} {'fill us':>9} {'accept us':>10} {'step us':>9} "
                  f"{'p99 us':>9} {'us/row':>7} {'blocked':>7} {'refused':>7}")
            modes = ["serial"] + (["parallel"] if lib.fill_batch else [])
            for batch, mode in [(args.batch, m) for m in modes] + [(1, "serial")]:
                row = emit("mask", lib, mask_row(lib, compiled["json_large"], docs, batch,
                                                 steps if batch > 1 else len(docs[0]), mode, vocab))
                masks.append(row)
                print(f"{row['batch']:5d} {row['mode']:>9} {row['steps']:6d} {row['fill_mean_us']:9.1f} "
                      f"{row['accept_mean_us']:10.1f} {row['step_mean_us']:9.1f} {row['step_p99_us']:9.1f} "
                      f"{row['per_row_us']:7.1f} {row['blocked']:7d} {row['refused']:7d}", flush=True)
        features = feature_rows(lib, tok, vocab)
        for row in features:
            emit("feature", lib, row)
            print(f"feature: {row['feature']}: {row['result']}")
        results[name] = dict(lib=lib, compile=rows, checks=checks, masks=masks, features=features)

    sets = {name: next((c["_set"] for c in r["checks"] if "_set" in c), None) for name, r in results.items()}
    sets = {name: s for name, s in sets.items() if s is not None}
    if len(sets) > 1:
        same = len({tuple(s) for s in sets.values()}) == 1
        emit("check", None, dict(check="choice_5 first masks equal across libraries", result=same))
        print(f"\ncheck: choice_5 first masks equal across {', '.join(sets)}: {same}")

    print(f"\n{'apply (CPU)':>60} {'batch':>5} {'us':>9} {'first ms':>9} {'same':>5}")
    for row in apply_rows(args.batch, vocab, "xgrammar" in results, args.compiled_apply):
        emit("apply", None, row)
        print(f"{row['way']:>60} {row['batch']:5d} {row['us']:9.1f} {row['first_ms']:9.1f} {str(row['same']):>5}")

    if len(results) > 1:
        print("\nfeatures: " + " | ".join(results))
        for i, row in enumerate(next(iter(results.values()))["features"]):
            print(f"  {row['feature']}: " + " | ".join(r["features"][i]["result"] for r in results.values()))


if __name__ == "__main__":
    main()
