"""Structured outputs' cost: a batch of requests held to a JSON schema against the same batch free,
through Spillway's `LLM` in one process, and the compile time of a 50-property schema.

    python tools/bench/engine/structured.py                          # the default model on this machine
    python tools/bench/engine/structured.py --model /tmp/models/qwen3-8b --load-format dummy --batch 64

Rows:
  compile    the 50-property schema of tools/bench/grammar/backends.py compiled by the worker's
             grammar compiler (worker/sample/grammars.py): the first time (the tokenizer's
             vocabulary included, as a worker's first constrained request pays it) and again (cached).
  batch      `--batch` chat requests, each asking for a record as JSON, `--output-len` tokens at most:
             free (greedy, EOS ignored) and held to a schema that cannot close within the length (an
             array of at least 1,024 strings), alternated `--rounds` times; output tokens/s of each (median)
             and their ratio, the baseline being the free batch of the same run. A constrained step
             never runs ahead of the host and fills its masks on the CPU beside the forward: the ratio
             is what that costs.

The model folder needs a tokenizer (a built-in config name has none: build one with
`tools/bench/engine/peer_offline.py --build NAME`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

# At least 1,024 items of 4 characters or more: no answer closes within 2,000 tokens, so a
# constrained batch produces as many tokens as a free one.
LONG_SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 40},
    "items": {"type": "array", "minItems": 1024, "items": {"type": "string", "minLength": 4, "maxLength": 24}}},
    "required": ["title", "items"]}
ASK = [{"role": "user", "content": "Write a long record as JSON: a title and many items."}]


def compile_row(model: str | None, load_format: str) -> dict:
    from spillway.protocol.local import model_files
    from spillway.protocol.messages import StructuredKind, StructuredOutput
    from spillway.tools.bench.grammar.backends import large_schema
    from spillway.worker.models import loader
    from spillway.worker.sample.grammars import GrammarCompiler

    files = model_files.resolve_model(model, load_format)
    config = loader.load_config(files)
    compiler = GrammarCompiler(files, int(config.vocab_size), loader.eos_token_ids(files, config))
    structured = StructuredOutput(kind=StructuredKind.JSON, spec=json.dumps(large_schema()))
    started = time.perf_counter()
    compiler.compile(structured)
    first_ms = (time.perf_counter() - started) * 1e3
    started = time.perf_counter()
    compiler.compile(structured)
    cached_ms = (time.perf_counter() - started) * 1e3
    compiler.close()
    return dict(row="compile", schema="50 properties", first_ms=round(first_ms, 2), cached_ms=round(cached_ms, 3))


def batch_rows(args) -> dict:
    from spillway.gateway import LLM, SamplingParams, StructuredOutputsParams

    llm = LLM(args.model, load_format=args.load_format, dtype=args.dtype, device=args.device,
              max_num_seqs=args.batch, max_model_len=args.output_len + 256)
    free = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    constrained = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True,
                                 structured_outputs=StructuredOutputsParams(json=LONG_SCHEMA))
    llm.chat([ASK] * 2, [free, constrained], use_tqdm=False)  # warm-up, the grammar compiled
    rates: dict[str, list[float]] = {"free": [], "schema": []}
    tokens: dict[str, int] = {}
    for _ in range(args.rounds):
        for label, params in (("free", free), ("schema", constrained)):
            llm.reset_prefix_cache()
            started = time.perf_counter()
            outputs = llm.chat([ASK] * args.batch, params, use_tqdm=False)
            elapsed = time.perf_counter() - started
            tokens[label] = sum(len(o.outputs[0].token_ids) for o in outputs)
            rates[label].append(tokens[label] / elapsed)
    llm.shutdown()
    accepted = sum(followed_schema(args.model, args.load_format, o.outputs[0].token_ids) for o in outputs)
    free_rate, schema_rate = statistics.median(rates["free"]), statistics.median(rates["schema"])
    return dict(row="batch", batch=args.batch, output_len=args.output_len, free_tok_s=round(free_rate, 1),
                schema_tok_s=round(schema_rate, 1), ratio=round(schema_rate / free_rate, 3),
                free_tokens=tokens["free"], schema_tokens=tokens["schema"], rounds=args.rounds,
                schema_outputs_accepted=f"{accepted}/{len(outputs)}")


def followed_schema(model: str | None, load_format: str, token_ids: list[int]) -> bool:
    """Whether a fresh matcher of the schema accepts every token of an output (the last round's)."""
    from spillway.protocol.local import model_files
    from spillway.protocol.messages import StructuredKind, StructuredOutput
    from spillway.worker.models import loader
    from spillway.worker.sample.grammars import GrammarCompiler

    if not _COMPILED:
        files = model_files.resolve_model(model, load_format)
        config = loader.load_config(files)
        compiler = GrammarCompiler(files, int(config.vocab_size), loader.eos_token_ids(files, config))
        _COMPILED.append((compiler, compiler.compile(StructuredOutput(kind=StructuredKind.JSON,
                                                                       spec=json.dumps(LONG_SCHEMA)))))
    compiler, compiled = _COMPILED[0]
    grammar = compiler.grammar(compiled)
    return all(grammar.accept(token) for token in token_ids)


_COMPILED: list = []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a model folder with a tokenizer (default: the default model)")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", help="append each row to this file as a JSON line")
    args = parser.parse_args()
    from spillway.tools.bench.ceilings import machine

    where = machine()
    print(where)
    for row in (compile_row(args.model, args.load_format), batch_rows(args)):
        print(json.dumps(row))
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps({**row, "machine": where}) + "\n")


if __name__ == "__main__":
    main()
