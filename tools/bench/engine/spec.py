"""Speculative decoding on the GPU: each figure beside plain decoding measured in the same run,
on the same engine (speculation attached and detached between runs, nothing else changed).

    python tools/bench/engine/spec.py --decode [--k 1,2,4,8]           # batch 1, replayed outputs
    python tools/bench/engine/spec.py --decode --ngram --quote-back --model MODEL.gguf   # and n-gram, real text
    python tools/bench/engine/spec.py --draft [--draft-layers 4]        # batch 1, a draft model
    python tools/bench/engine/spec.py --throughput [--batches 32,128,512]
    python tools/bench/engine/spec.py                                   # all three
    python tools/bench/engine/spec.py --report results.jsonl            # the table of earlier runs

    decode      greedy, one request at a time: a plain run records the target's output for each
                prompt, then the same prompts with the replay proposer proposing it (every
                draft accepted: the verification's ceiling), for each k. Output tokens/s of
                the decode (prefill left out); acceptance and accepted drafts per verified step.
                --ngram adds n-gram prompt lookup for each k; --quote-back makes the prompts
                repetitive text (a file of this tree, then its first tokens again: the model
                quotes it back), which needs real weights
    draft       the same with a draft model that is the target cut to its first N layers (same
                embedding, layers, norm and head, written as a checkpoint the draft-model
                proposer loads), once with the switch as built and once always on
    throughput  N requests x (input-len in, output-len out), all at once, greedy: output tokens/s
                with n-gram and with replayed speculation against none, prefills included; the
                ratio's target: the switch turns speculation off where it does not pay

The model is a built-in config with dummy weights (default qwen3-8b), a checkpoint folder or a
GGUF file. Dummy weights make a poor draft of themselves: each layer adds an update as large
as the stream it reads, so the first N layers foretell nothing of the rest and a cut draft's
acceptance is about 0 (its rows then measure the switch's protection; a whole copy accepts
every draft). Real weights give a measurable one: --model with the default model's GGUF; so
does --draft-damp F, which scales the norms of the target's layers past the draft's by F (the
target of every row, the plain one included), so that those layers only nudge the stream the
draft's layers computed.
--quick takes small sizes (a minute or two on an H200).
Every row is printed as it is measured and again in the table at the end; --results FILE
also appends each row (with command, machine and date) as a JSON line.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import tempfile
from datetime import date
from pathlib import Path
from typing import TYPE_CHECKING


from spillway.protocol.config import SpeculativeConfig  # noqa: E402
from spillway.protocol.local.model_files import builtin_config_names, load_config, resolve_model  # noqa: E402
from spillway.tools.bench import result_rows  # noqa: E402
from spillway.tools.bench.result_rows import Rows, print_table, row  # noqa: E402

if TYPE_CHECKING:  # spec_runs imports the engine and torch: where it runs, not for --help
    from spillway.tools.bench.engine.spec_runs import CountedSpec, Run

THROUGHPUT_TARGET = 0.97  # speculation on / off: where it does not pay, the switch turns it off


def spec_counts(spec: CountedSpec, run: Run, baseline: Run) -> dict[str, int]:
    """What a run with speculation did, beside the plain run's steps and tokens."""
    from spillway.tools.bench.engine.spec_runs import matching_tokens

    metrics = spec.metrics
    return dict(draft_tokens=metrics.num_draft_tokens, accepted_tokens=metrics.num_accepted_tokens,
                verified=metrics.num_drafts, steps=run.steps, plain_steps=baseline.steps,
                switch_on=spec.steps_on, switch_off=spec.steps_off, drafted_steps=spec.steps_drafted,
                tokens=sum(len(output) for output in baseline.outputs),
                tokens_as_plain=matching_tokens(run.outputs, baseline.outputs))


def spec_row(name: str, run: Run, baseline: Run, spec: CountedSpec, note: str, target: float | None = None) -> dict:
    """A row with acceptance, accepted drafts per verified step, the switch's answers and how
    far the outputs follow the plain run's (greedy: equal but for rounding); `counts` holds
    the figures."""
    counts = spec_counts(spec, run, baseline)
    drafted, accepted = counts["draft_tokens"], counts["accepted_tokens"]
    note += (f"; acceptance {accepted / max(drafted, 1):.3f} ({accepted}/{drafted} drafts), "
             f"{accepted / max(counts['verified'], 1):.2f} accepted per verified request-step; {run.steps} steps "
             f"(plain {baseline.steps}): switch on {counts['switch_on']}, off {counts['switch_off']}, drafted "
             f"{counts['drafted_steps']}; tokens as the plain run {counts['tokens_as_plain']}/{counts['tokens']}")
    result = row(name, run.tokens_per_s, "tok/s", "no speculation", baseline.tokens_per_s,
                 run.tokens_per_s / baseline.tokens_per_s, target=target, note=note)
    result["counts"] = counts
    return result


class DecodeBench:
    """Batch 1 on one engine: the plain baseline first, then runs with speculation."""

    def __init__(self, args) -> None:
        from spillway.tools.bench.engine.spec_runs import (blocks_for, damp_layers_after, decode_one_at_a_time, make_engine,
                                                  quote_back_prompts, random_prompts, write_replay)

        self.args = args
        self.max_k = max([*args.k, args.draft_k])
        max_model_len = args.prompt_len + args.new_tokens + self.max_k + 16
        self.engine = make_engine(args.model, args.device, max_model_len=max_model_len, max_num_seqs=1,
                                  num_blocks=blocks_for(max_model_len, 16, 2), async_scheduling=args.async_scheduling)
        if args.draft_damp is not None:  # before the baseline: the target of every row
            damp_layers_after(self.engine, min(args.draft_layers), args.draft_damp)
        if args.quote_back:
            self.prompts = quote_back_prompts(args.model, args.num_prompts, args.prompt_len)
        else:
            self.prompts = random_prompts(args.num_prompts, args.prompt_len, self.engine.vocab_size, seed=1)
        self.warm_prompt = random_prompts(1, args.prompt_len, self.engine.vocab_size, seed=2)
        self.folder = Path(tempfile.mkdtemp(prefix="bench-spec-"))
        self.warm_tokens = min(4 * self.max_k, args.new_tokens)
        decode_one_at_a_time(self.engine, self.warm_prompt, self.warm_tokens, "warm")
        self.plain = decode_one_at_a_time(self.engine, self.prompts, args.new_tokens, "plain")
        write_replay(self.folder / "replay.jsonl", self.prompts, self.plain.outputs)
        self.name = f"decode {args.model_name} batch 1"
        kind = "documents quoted back" if args.quote_back else "random prompts"
        self.shape = f"{args.num_prompts} {kind} of {args.prompt_len} tokens, {args.new_tokens} new each"
        if args.draft_damp is not None:
            self.shape += f"; target's norms past layer {min(args.draft_layers)} scaled by {args.draft_damp}"

    def measure(self, rows: Rows, label: str, config: SpeculativeConfig, always_on: bool = False) -> None:
        """One timed run with `config`, after a warm-up (the verification's first steps compile
        kernels for their shapes; the switch starts from what the warm-up measured)."""
        from spillway.tools.bench.engine.spec_runs import attach_spec, decode_one_at_a_time, recount

        attach_spec(self.engine, config, always_on=always_on)
        decode_one_at_a_time(self.engine, self.warm_prompt, self.warm_tokens, "warm")
        spec = recount(self.engine)
        run = decode_one_at_a_time(self.engine, self.prompts, self.args.new_tokens, label.replace(" ", "-"))
        attach_spec(self.engine, None)
        rows.add(spec_row(f"{self.name} {label}", run, self.plain, spec, self.shape))

    def close(self) -> None:
        shutil.rmtree(self.folder)  # a draft checkpoint: gigabytes
        del self.engine
        free_memory()


def run_decode(bench: DecodeBench, rows: Rows) -> None:
    args = bench.args
    rows.add(row(f"{bench.name} no speculation", bench.plain.tokens_per_s, "tok/s", note=bench.shape))
    for k in args.k:
        bench.measure(rows, f"replay k={k}", SpeculativeConfig(
            method="replay", num_speculative_tokens=k, replay_path=str(bench.folder / "replay.jsonl")))
    for k in args.k if args.ngram else ():
        bench.measure(rows, f"n-gram k={k}", SpeculativeConfig(method="ngram", num_speculative_tokens=k))


def run_draft(bench: DecodeBench, rows: Rows) -> None:
    from spillway.tools.bench.engine.spec_runs import write_truncated_copy

    args = bench.args
    num_layers = bench.engine.runner.model.spec.num_layers
    for layers in args.draft_layers:
        folder = bench.folder / f"draft-{layers}"
        write_truncated_copy(bench.engine, layers, folder)
        free_memory()
        config = SpeculativeConfig(method="draft_model", model=str(folder), num_speculative_tokens=args.draft_k)
        for always_on in (False, True):
            switch = "switch always on" if always_on else "switch as built"
            bench.measure(rows, f"draft {layers}/{num_layers} layers k={args.draft_k}, {switch}", config, always_on)
            free_memory()


def run_throughput(args, rows: Rows) -> None:
    from spillway.tools.bench.engine.spec_runs import (attach_spec, blocks_for, generate_all_at_once, make_engine,
                                              random_prompts, write_replay)

    max_model_len = args.input_len + args.output_len + args.throughput_k + 16
    num_blocks = None if args.device == "cuda" else blocks_for(max_model_len, 16, max(args.batches))
    engine = make_engine(args.model, args.device, max_model_len=max_model_len, max_num_seqs=max(args.batches),
                         num_blocks=num_blocks, async_scheduling=args.async_scheduling)
    folder = Path(tempfile.mkdtemp(prefix="bench-spec-"))
    methods = {"ngram": dict(method="ngram"),
               "replay": dict(method="replay", replay_path=str(folder / "replay.jsonl"))}
    warm = random_prompts(min(args.batches), args.input_len, engine.vocab_size, seed=3)
    warm_out = generate_all_at_once(engine, warm, 2 * args.throughput_k + 4, "warm")
    write_replay(folder / "replay.jsonl", warm, warm_out.outputs)
    for settings in methods.values():
        attach_spec(engine, SpeculativeConfig(num_speculative_tokens=args.throughput_k, **settings))
        generate_all_at_once(engine, warm, 2 * args.throughput_k + 4, "warm")
    for batch in args.batches:
        prompts = random_prompts(batch, args.input_len, engine.vocab_size, seed=10 + batch)
        attach_spec(engine, None)
        write_replay(folder / "replay.jsonl", prompts,
                     generate_all_at_once(engine, prompts, args.output_len, f"record-{batch}").outputs)
        # --repeats rounds of every setting in turn: a drift of the machine reaches them alike,
        # and each row keeps its median run.
        runs: dict[str, list[tuple[Run, CountedSpec | None]]] = {"plain": [], **{m: [] for m in methods}}
        for repeat in range(args.repeats):
            for method, settings in [("plain", None), *methods.items()]:
                spec = attach_spec(engine, settings and SpeculativeConfig(num_speculative_tokens=args.throughput_k,
                                                                          **settings))
                runs[method].append((generate_all_at_once(engine, prompts, args.output_len,
                                                          f"{method}-{batch}-{repeat}"), spec))
        attach_spec(engine, None)
        name = f"throughput {args.model_name} batch {batch}"
        shape = f"{batch} x ({args.input_len} in, {args.output_len} out), median of {args.repeats}"
        plain, _ = median_run(runs["plain"])
        rows.add(row(f"{name} no speculation", plain.tokens_per_s, "tok/s", note=f"{shape}, {plain.seconds:.2f} s"))
        for method in methods:
            run, spec = median_run(runs[method])
            rows.add(spec_row(f"{name} {method} k={args.throughput_k}", run, plain, spec,
                              f"{shape}, {run.seconds:.2f} s", target=THROUGHPUT_TARGET))
    shutil.rmtree(folder)
    del engine
    free_memory()


def median_run(runs: list[tuple[Run, CountedSpec | None]]) -> tuple[Run, CountedSpec | None]:
    """The run of median time (the upper one of an even count) with its speculation."""
    return sorted(runs, key=lambda pair: pair[0].seconds)[len(runs) // 2]


def free_memory() -> None:
    """The next engine or draft sizes itself from free memory: give back what is unreferenced."""
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def positive_ints(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return values


def positive_int(text: str) -> int:
    values = positive_ints(text)
    if len(values) != 1:
        raise argparse.ArgumentTypeError(f"expected one positive integer, got {text!r}")
    return values[0]


def model_layers(model: str) -> int | None:
    """The decoder layers of `model`'s config; None where no config is found."""
    fmt = "dummy" if model in builtin_config_names() else "auto"
    try:
        return int(load_config(resolve_model(model, fmt)).num_hidden_layers)
    except (ValueError, OSError):
        return None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--decode", action="store_true", help="batch 1, the replay proposer, for each --k")
    parser.add_argument("--ngram", action="store_true", help="decode: n-gram prompt lookup too, for each --k")
    parser.add_argument("--quote-back", action="store_true",
                        help="decode, draft: prompts are documents the model quotes back (repetitive text; "
                             "needs a model with its tokenizer and real weights)")
    parser.add_argument("--draft", action="store_true", help="batch 1, the target's first --draft-layers as draft")
    parser.add_argument("--throughput", action="store_true", help="--batches requests at once, n-gram and replay")
    parser.add_argument("--quick", action="store_true", help="small sizes: a minute or two on an H200")
    parser.add_argument("--model", default="qwen3-8b", help="a built-in config (dummy weights) or a model folder")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--k", type=positive_ints, default=[1, 2, 4, 8], help="decode: drafts per step, e.g. 1,2,4,8")
    parser.add_argument("--num-prompts", type=positive_int, help="decode, draft: prompts, one at a time (3)")
    parser.add_argument("--prompt-len", type=positive_int, help="decode, draft: tokens per prompt (128)")
    parser.add_argument("--new-tokens", type=positive_int, help="decode, draft: output tokens per prompt (256)")
    parser.add_argument("--draft-layers", type=positive_ints, default=[4], help="draft: the draft's layers, e.g. 2,4")
    parser.add_argument("--draft-k", type=positive_int, default=4, help="draft: drafts per step")
    parser.add_argument("--draft-damp", type=float, metavar="F",
                        help="scale the norms of the target's layers past the first --draft-layers by F "
                             "(e.g. 0.05), so the cut draft foretells it (a measurable acceptance)")
    parser.add_argument("--batches", type=positive_ints, help="throughput: requests at once (32,128,512)")
    parser.add_argument("--input-len", type=positive_int, help="throughput: prompt tokens (256)")
    parser.add_argument("--output-len", type=positive_int, help="throughput: output tokens (256)")
    parser.add_argument("--throughput-k", type=positive_int, default=4, help="throughput: drafts per step")
    parser.add_argument("--repeats", type=positive_int, default=3,
                        help="throughput: rounds of every setting in turn; each row keeps its median run")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                        help="overlap the next step's scheduling with this one (default: on with CUDA)")
    parser.add_argument("--results", help="append every row here as a JSON line")
    parser.add_argument("--report", metavar="FILE", help="print the table of FILE's rows and exit")
    args = parser.parse_args(argv)
    if args.report:
        return args
    quick = args.quick
    for name, full, small in (("num_prompts", 3, 1), ("prompt_len", 128, 64), ("new_tokens", 256, 128),
                              ("batches", [32, 128, 512], [32, 128]), ("input_len", 256, 128),
                              ("output_len", 256, 64)):
        if getattr(args, name) is None:
            setattr(args, name, small if quick else full)
    if args.new_tokens < 2 * (max([*args.k, args.draft_k]) + 1):
        parser.error("--new-tokens: at least twice the largest k + 1 (the first call's tokens are not timed)")
    if args.output_len < 2:
        parser.error("--output-len: at least 2")
    if not (args.decode or args.draft or args.throughput):
        args.decode = args.draft = args.throughput = True
    args.model_name = Path(args.model).name
    num_layers = model_layers(args.model)
    if num_layers is None:
        parser.error(f"--model: {args.model!r} is neither a built-in config ({', '.join(builtin_config_names())}) "
                     "nor a model folder or .gguf file")
    if args.quote_back and args.model in builtin_config_names():
        parser.error("--quote-back: a built-in config has dummy weights, which quote nothing; give a model "
                     "folder or .gguf file")
    if args.draft_damp is not None and not 0 < args.draft_damp <= 1:
        parser.error(f"--draft-damp: a factor in (0, 1], got {args.draft_damp}")
    if args.draft and max(args.draft_layers) > num_layers:
        parser.error(f"--draft-layers: {max(args.draft_layers)} is more than {args.model}'s {num_layers} layers")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.report:
        with open(args.report) as f:
            print_table([json.loads(line) for line in f if line.strip()])
        return
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("tools/bench/engine/spec.py needs a CUDA GPU (or --device cpu)")
    if args.device == "cuda":
        from spillway.tools.bench.ceilings import machine

        result_rows.MACHINE = machine()
    else:
        result_rows.MACHINE = f"CPU ({os.cpu_count()} cores)"
    print(f"{result_rows.MACHINE}, {date.today()}")
    rows = Rows(args.results)
    if args.decode or args.draft:
        bench = DecodeBench(args)
        if args.decode:
            run_decode(bench, rows)
        if args.draft:
            run_draft(bench, rows)
        bench.close()
    if args.throughput:
        run_throughput(args, rows)
    print()
    print_table(rows.rows)


if __name__ == "__main__":
    main()
