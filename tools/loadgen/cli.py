"""`python -m tools.loadgen --url URL [options]` and `python -m tools.loadgen --compare A.json B.json`."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import shlex
import sys
import time
from dataclasses import asdict, dataclass

import httpx

from . import plot
from .client import RequestOptions
from .corpus import RandomTokenPrompts, prompt_source, stdlib_words
from .dataset import Dataset, dataset_conversations, load_dataset
from .report import (
    DEFAULT_PERCENTILES,
    load_results,
    results_document,
    summarize,
    write_results,
)
from .runner import LoadShape, Runner
from .server_metrics import MetricsWatcher
from .table import format_compare, format_summary
from .workloads import (
    CHAT_WORKLOADS,
    DEFAULTS,
    WORKLOADS,
    Lengths,
    WorkloadSpec,
    conversations,
    num_conversations,
)

DEFAULT_NUM_REQUESTS = 100
SLO_NAMES = ("ttft", "tpot", "e2e")


def parse_slo(text: str) -> dict[str, float]:
    """`ttft=500,tpot=50` (milliseconds) -> {"ttft": 500.0, "tpot": 50.0}."""
    slo = {}
    for item in filter(None, text.split(",")):
        name, _, value = item.partition("=")
        if name.strip() not in SLO_NAMES or not value:
            raise argparse.ArgumentTypeError(f"an SLO is NAME=MS with NAME in {', '.join(SLO_NAMES)}, got {item!r}")
        slo[name.strip()] = float(value)
    return slo


def parse_percentiles(text: str) -> tuple[float, ...]:
    """`50,90,99` -> (50.0, 90.0, 99.0): vLLM bench's --metric-percentiles, each in (0, 100]."""
    try:
        values = tuple(float(item) for item in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"percentiles are numbers separated by commas, got {text!r}") from None
    if not all(0 < q <= 100 for q in values):
        raise argparse.ArgumentTypeError(f"each percentile must be in (0, 100], got {text!r}")
    return tuple(dict.fromkeys(values))


def _lengths(text: str) -> Lengths:
    try:
        return Lengths.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive(kind):
    def parse(text: str):
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value
    return parse


def _non_negative(kind):
    def parse(text: str):
        value = kind(text)
        if value < 0:
            raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
        return value
    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tools.loadgen",
                                     description="Load generator for OpenAI-compatible LLM servers (Spillway, vLLM).")
    parser.add_argument("--url", help="the server's base URL, e.g. http://127.0.0.1:8000 (the only address contacted)")
    parser.add_argument("--compare", nargs=2, metavar=("A.json", "B.json"), help="print two saved runs side by side")
    parser.add_argument("--model", help="model name to send (default: the first of the server's /v1/models)")
    parser.add_argument("--api-key", metavar="KEY", help="sent as `Authorization: Bearer KEY`")
    parser.add_argument("--endpoint", choices=["completions", "chat"],
                        help="default: chat for multi-turn and reasoning, completions otherwise")
    _add_workload_args(parser)
    _add_load_args(parser)
    _add_results_args(parser)
    return parser


def _add_workload_args(parser: argparse.ArgumentParser) -> None:
    work = parser.add_argument_group("workload (lengths in tokens: N or LOW:HIGH)")
    work.add_argument("--workload", choices=WORKLOADS, default="random")
    work.add_argument("--dataset", metavar="FILE",
                      help="replay prompts from a ShareGPT JSON file or JSON lines of prompts instead of a "
                      "workload (output lengths from the file's replies, or --output-len)")
    work.add_argument("--input-len", type=_lengths, metavar="LEN",
                      help="each request's own prompt text: the prompt (random), "
                      "the question (shared-prefix, document-qa, reasoning), each user message (multi-turn)")
    work.add_argument("--output-len", type=_lengths, metavar="LEN",
                      help="output tokens per request (exact with --ignore-eos)")
    work.add_argument("--prefix-len", type=_lengths, default=Lengths(512, 512), metavar="LEN",
                      help="shared-prefix: each system prompt's length (default 512)")
    work.add_argument("--num-prefixes", type=_positive(int), default=4, metavar="N",
                      help="shared-prefix: distinct system prompts (default 4)")
    work.add_argument("--document-len", type=_lengths, default=Lengths(2000, 2000), metavar="LEN",
                      help="document-qa: the document's length (default 2000)")
    work.add_argument("--num-turns", type=_positive(int), metavar="N",
                      help="multi-turn: turns per conversation (default 4)")
    work.add_argument("--num-users", type=_positive(int), metavar="N",
                      help="multi-turn: conversations open at once (default: --concurrency, else 16)")
    work.add_argument("--think-time", type=_non_negative(float), default=0.0, metavar="S",
                      help="multi-turn: a user's mean wait in seconds after a reply before the next turn, drawn "
                      "exponentially (default 0: at once); meanwhile the slot serves other users")
    work.add_argument("--thinking-budget", type=_positive(int), metavar="TOKENS",
                      help="reasoning: thinking_budget sent (default 128)")
    work.add_argument("--seed", type=int, default=0)
    work.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                      help="send ignore_eos and min_tokens so outputs are as long as asked (vLLM extensions)")
    work.add_argument("--temperature", type=float, default=0.0)
    work.add_argument("--json-schema", metavar="FILE",
                      help="hold every answer to the JSON schema in FILE: sent as OpenAI's response_format "
                      "(json_schema, strict); a schema that cannot close within --output-len keeps lengths exact")


def _add_load_args(parser: argparse.ArgumentParser) -> None:
    load = parser.add_argument_group("load shape (the run stops at --num-requests or --duration)")
    load.add_argument("--concurrency", type=_positive(int), metavar="N",
                      help="requests in flight (closed loop); with --request-rate, a cap (default 1)")
    load.add_argument("--request-rate", type=_positive(float), default=math.inf, metavar="PER_S",
                      help="arrivals per second (open loop)")
    load.add_argument("--burstiness", type=_positive(float), default=1.0, metavar="SHAPE",
                      help="shape of the gamma arrival process: 1 is Poisson, < 1 burstier, > 1 steadier")
    load.add_argument("--num-requests", type=_positive(int), metavar="N",
                      help=f"default {DEFAULT_NUM_REQUESTS} without --duration")
    load.add_argument("--duration", type=_positive(float), metavar="S",
                      help="seconds after which no new request starts")
    load.add_argument("--timeout", type=_positive(float), default=600.0, metavar="S",
                      help="per-request limit in seconds (default 600)")


def _add_results_args(parser: argparse.ArgumentParser) -> None:
    out = parser.add_argument_group("results")
    out.add_argument("--slo", type=parse_slo, default={}, metavar="NAME=MS,...",
                     help="goodput SLOs in ms, e.g. ttft=500,tpot=50[,e2e=...]")
    out.add_argument("--percentiles", type=parse_percentiles, default=DEFAULT_PERCENTILES, metavar="Q,Q,...",
                     help="the percentiles of TTFT, TPOT, ITL, E2E and lengths to report, e.g. 50,90,99 "
                          "(default 90,99)")
    out.add_argument("--metrics-interval", type=_positive(float), default=1.0, metavar="S",
                     help="seconds between /metrics samples (default 1)")
    out.add_argument("--server-metrics", action=argparse.BooleanOptionalAction, default=True,
                     help="read the server's /metrics before, during and after the run")
    out.add_argument("--output", metavar="RESULTS.json",
                     help="write every request's record and the summary to this JSON file")
    out.add_argument("--plot", metavar="PLOT.png",
                     help="draw latency distributions and throughput over time to this PNG")
    out.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True)


def workload_spec(args: argparse.Namespace) -> WorkloadSpec:
    defaults = DEFAULTS[args.workload]
    return WorkloadSpec(
        name=args.workload,
        input_len=args.input_len or Lengths.parse(defaults["input_len"]),
        output_len=args.output_len or Lengths.parse(defaults["output_len"]),
        prefix_len=args.prefix_len, num_prefixes=args.num_prefixes, document_len=args.document_len,
        num_turns=args.num_turns or int(defaults.get("num_turns", 1)),
        thinking_budget=args.thinking_budget or int(defaults.get("thinking_budget", 0)) or None, seed=args.seed,
        think_time_s=args.think_time)


def describe_workload(spec: WorkloadSpec) -> str:
    io = f"input {spec.input_len}, output {spec.output_len} tokens"
    extra = {"shared-prefix": f"{spec.num_prefixes} system prompts of {spec.prefix_len} tokens; questions: ",
             "document-qa": f"one document of {spec.document_len} tokens; questions: ",
             "multi-turn": f"{spec.num_turns} turns per conversation"
                           f"{f', think time {spec.think_time_s:g} s' if spec.think_time_s else ''}; each turn: ",
             "reasoning": f"thinking_budget {spec.thinking_budget}; "}.get(spec.name, "")
    return f"{spec.name}, seed {spec.seed}: {extra}{io}"


async def _served_model(http: httpx.AsyncClient) -> str | None:
    try:
        response = await http.get("/v1/models", timeout=10.0)
        response.raise_for_status()
        return response.json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        return None


async def _replay(items):
    for item in items:
        yield item


@dataclass(slots=True)
class RunSettings:
    """The command line resolved: defaults filled in, checked before anything is sent."""

    url: str
    endpoint: str
    spec: WorkloadSpec
    shape: LoadShape
    max_open_conversations: int
    command: str
    dataset: Dataset | None = None
    response_format: dict | None = None


def resolve(args: argparse.Namespace, argv: list[str]) -> RunSettings:
    """The settings of a run; ValueError names what is wrong on the command line."""
    spec = workload_spec(args)
    if spec.think_time_s and spec.name != "multi-turn":
        raise ValueError("--think-time is the wait between a conversation's turns: --workload multi-turn only")
    dataset = None
    if args.dataset:
        if args.workload != "random":
            raise ValueError("--dataset replays single prompts: leave --workload out")
        try:
            dataset = load_dataset(args.dataset)
        except OSError as exc:
            raise ValueError(f"--dataset: {exc}") from None
        if args.output_len is None and any(i.output_len is None and i.reply is None for i in dataset.items):
            raise ValueError(f"--dataset {args.dataset}: some prompts give no output length; add --output-len")
    response_format = None if args.json_schema is None else json_schema_format(args.json_schema)
    concurrency = args.concurrency if args.concurrency or not math.isinf(args.request_rate) else 1
    num_requests = args.num_requests or (None if args.duration else DEFAULT_NUM_REQUESTS)
    shape = LoadShape(concurrency, args.request_rate, args.burstiness, num_requests, args.duration, args.seed)
    endpoint = args.endpoint or ("chat" if spec.name in CHAT_WORKLOADS else "completions")
    return RunSettings(args.url.rstrip("/").removesuffix("/v1"), endpoint, spec, shape,
                       args.num_users or concurrency or 16, "python -m tools.loadgen " + shlex.join(argv), dataset,
                       response_format)


def json_schema_format(path: str) -> dict:
    """OpenAI's response_format holding answers to the JSON schema in the file at `path`."""
    try:
        with open(path) as f:
            schema = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"--json-schema {path}: {exc}") from None
    if not isinstance(schema, dict):
        raise ValueError(f"--json-schema {path}: a JSON schema is an object, not {type(schema).__name__}")
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


async def run(args: argparse.Namespace, settings: RunSettings) -> dict:
    """One load test; returns its results document (see report.results_document)."""
    spec, shape = settings.spec, settings.shape
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(base_url=settings.url, headers=headers, trust_env=False, follow_redirects=False,
                                 timeout=httpx.Timeout(args.timeout, connect=min(10.0, args.timeout)),
                                 limits=httpx.Limits(max_connections=None, max_keepalive_connections=256)) as http:
        model = args.model or await _served_model(http)
        prompts = await prompt_source(http, model, stdlib_words())
        if isinstance(prompts, RandomTokenPrompts):
            print(f"loadgen: prompts are {prompts.source}", file=sys.stderr)
        if settings.dataset is not None:
            source = dataset_conversations(settings.dataset, prompts, shape.num_requests, args.output_len, spec.seed)
        else:
            source = conversations(spec, prompts, num_conversations(spec, shape.num_requests))
        if shape.num_requests is not None:  # fit every prompt before the clock starts
            if args.progress:
                print(f"loadgen: preparing {shape.num_requests} requests' prompts", file=sys.stderr)
            source = _replay([c async for c in source])
        options = RequestOptions(settings.endpoint, model, args.ignore_eos, args.temperature, args.timeout,
                                 settings.response_format)
        watcher = MetricsWatcher(http, args.metrics_interval) if args.server_metrics else None
        if watcher is not None:
            await watcher.start()
        progress = _Progress(shape.num_requests, args.progress)
        runner = Runner(http, options, shape, settings.max_open_conversations, progress.update_for)
        t0 = time.perf_counter()
        try:
            records = await runner.run(source, t0)
        finally:
            progress.close()
        if watcher is not None:
            await watcher.stop()
    server = watcher.report() if watcher is not None else None
    workload = "dataset" if settings.dataset is not None else spec.name
    description = (f"{settings.dataset.describe()}, seed {spec.seed}" if settings.dataset is not None
                   else describe_workload(spec))
    config = {"url": settings.url, "model": model, "endpoint": settings.endpoint, "workload": workload,
              "workload_description": description, "load": shape.describe(),
              "prompt_source": prompts.source, "spec": asdict(spec),
              "shape": dict(asdict(shape), request_rate=None if math.isinf(shape.request_rate) else shape.request_rate),
              "ignore_eos": args.ignore_eos, "temperature": args.temperature, "command": settings.command,
              "response_format": settings.response_format,
              "client": f"{platform.node()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
              "date": time.strftime("%Y-%m-%d %H:%M:%S %z")}
    samples = watcher.samples_since(t0) if watcher is not None else []
    return results_document(config, summarize(records, args.slo, server, args.percentiles), records, samples)


class _Progress:
    """A tqdm bar on stderr (hidden when stderr is not a terminal or with --no-progress)."""

    def __init__(self, total: int | None, enabled: bool) -> None:
        from tqdm import tqdm

        self.failed = 0
        self.bar = tqdm(total=total, unit="req", disable=None if enabled else True, file=sys.stderr,
                        dynamic_ncols=True, desc="requests")

    def update_for(self, record) -> None:
        if not record.ok:
            self.failed += 1
            self.bar.set_postfix(failed=self.failed, refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.compare:
        try:
            a, b = (load_results(path) for path in args.compare)
        except (OSError, ValueError) as exc:
            print(f"loadgen: {exc}", file=sys.stderr)
            return 2
        print(format_compare(a, b, *args.compare))
        return 0
    if not args.url:
        parser.error("--url is required (or --compare A.json B.json)")
    try:
        settings = resolve(args, sys.argv[1:] if argv is None else argv)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        document = asyncio.run(run(args, settings))
    except KeyboardInterrupt:
        print("loadgen: interrupted; no results", file=sys.stderr)
        return 130
    print(format_summary(document))
    if args.output:
        write_results(args.output, document)
        print(f"results written to {args.output}")
    if args.plot:
        try:
            plot.draw(document, args.plot)
            print(f"plot written to {args.plot}")
        except ImportError:
            print("loadgen: --plot needs matplotlib: pip install -e '.[loadgen]'", file=sys.stderr)
    return 0 if document["summary"]["num_ok"] > 0 else 1
