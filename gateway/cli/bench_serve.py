"""`spillway bench serve`: `vllm bench serve`'s flags, run by the load generator (tools/loadgen).

The flags become a loadgen command line (`loadgen_argv`, a pure function), so requests are
paced, sent and timed exactly as `python -m tools.loadgen` does; what loadgen cannot do (a
dataset it has no reader for, sampling knobs it does not send) is refused by name, exit
status 2. The summary is printed, and with `--save-result` saved, under vLLM's names.

    vLLM                                   loadgen
    --base-url | --host --port             --url
    --endpoint, --backend                  --endpoint completions|chat
    --dataset-name random                  --workload random (shared-prefix with --random-prefix-len)
    --dataset-name sharegpt|custom         --dataset FILE (--dataset-path)
    --dataset-name prefix_repetition       --workload shared-prefix
    --random-input-len, --random-range-ratio  --input-len LOW:HIGH
    --num-prompts, --request-rate, --burstiness, --max-concurrency, --seed, --goodput,
    --metric-percentiles, --disable-tqdm   --num-requests, ..., --concurrency, --slo, --percentiles, --no-progress
"""

from __future__ import annotations

import argparse
import math
import os
import sys

COMPLETIONS_ENDPOINT = "/v1/completions"
CHAT_ENDPOINT = "/v1/chat/completions"
BACKENDS = {"vllm": "completions", "openai": "completions", "openai-chat": "chat"}
DATASETS = ("random", "sharegpt", "custom", "prefix_repetition")
# vLLM's other datasets: parsed so that they are refused by name rather than as unknown choices.
OTHER_DATASETS = ("burstgpt", "sonnet", "hf", "random-mm", "random-rerank", "spec_bench")
METRICS = ("ttft", "tpot", "itl", "e2el")
GOODPUT_NAMES = {"ttft": "ttft", "tpot": "tpot", "e2el": "e2e"}  # vLLM's name -> loadgen's SLO name


class RefusedFlag(ValueError):
    """A flag asks for what the load generator cannot do."""


def add_args(parser: argparse.ArgumentParser) -> None:
    server = parser.add_argument_group("server")
    server.add_argument("--base-url", help="the server's address, e.g. http://127.0.0.1:8000 (instead of --host/--port)")
    server.add_argument("--host", default="127.0.0.1")
    server.add_argument("--port", type=int, default=8000)
    server.add_argument("--endpoint", help=f"{COMPLETIONS_ENDPOINT} or {CHAT_ENDPOINT} (default: by --backend)")
    server.add_argument("--backend", "--endpoint-type", default="vllm", choices=sorted(BACKENDS),
                        help="the request format: openai-chat sends chat completions")
    server.add_argument("--model", help="the model to ask for (default: the first of the server's /v1/models)")
    server.add_argument("--served-model-name", help="the name sent in requests, when not --model")
    server.add_argument("--trust-remote-code", action="store_true", help="accepted: no model is loaded here")
    data = parser.add_argument_group("dataset")
    data.add_argument("--dataset-name", default="random", choices=DATASETS + OTHER_DATASETS,
                      help=f"{', '.join(DATASETS)}; the others are refused")
    data.add_argument("--dataset-path", help="sharegpt: a ShareGPT JSON file; custom: JSON lines of {\"prompt\": ...}")
    data.add_argument("--num-prompts", type=int, default=1000)
    data.add_argument("--seed", type=int, default=0)
    data.add_argument("--random-input-len", type=int, default=1024)
    data.add_argument("--random-output-len", type=int, default=128)
    data.add_argument("--random-range-ratio", type=float, default=0.0,
                      help="lengths drawn from [len * (1 - r), len * (1 + r)], r in [0, 1)")
    data.add_argument("--random-prefix-len", type=int, default=0, help="a prefix shared by every random prompt")
    data.add_argument("--sharegpt-output-len", type=int, help="output tokens instead of the recorded reply's")
    data.add_argument("--custom-output-len", type=int, default=256, help="-1: the file's own lengths")
    data.add_argument("--prefix-repetition-prefix-len", type=int, default=256)
    data.add_argument("--prefix-repetition-suffix-len", type=int, default=256)
    data.add_argument("--prefix-repetition-num-prefixes", type=int, default=10)
    data.add_argument("--prefix-repetition-output-len", type=int, default=128)
    load = parser.add_argument_group("load")
    load.add_argument("--request-rate", type=float, default=math.inf, help="arrivals per second (inf: all at once)")
    load.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the arrivals: 1 is Poisson")
    load.add_argument("--max-concurrency", type=int, help="requests in flight at most")
    load.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (and min_tokens)")
    load.add_argument("--temperature", type=float, default=0.0)
    results = parser.add_argument_group("results")
    results.add_argument("--percentile-metrics", default="ttft,tpot,itl", help=f"of {','.join(METRICS)}")
    results.add_argument("--metric-percentiles", default="99", help="e.g. 25,50,99")
    results.add_argument("--goodput", nargs="+", metavar="NAME:MS", help="SLOs, e.g. ttft:500 tpot:50 e2el:2000")
    results.add_argument("--save-result", action="store_true", help="write the results to a JSON file")
    results.add_argument("--save-detailed", action="store_true", help="with every request's lengths and times")
    results.add_argument("--result-dir", help="where --save-result writes (default: here)")
    results.add_argument("--result-filename", help="default: LABEL-RATEqps[-concurrencyN]-MODEL-DATE.json")
    results.add_argument("--label", help="the results' label (default: --backend)")
    results.add_argument("--metadata", nargs="*", metavar="KEY=VALUE", help="added to the saved results")
    results.add_argument("--disable-tqdm", action="store_true")
    refused = parser.add_argument_group("not available (refused)")
    refused.add_argument("--tokenizer", help="prompts are measured with the server's /tokenize")
    for flag in ("--top-p", "--top-k", "--min-p", "--logprobs"):
        refused.add_argument(flag, type=float)
    refused.add_argument("--lora-modules", nargs="+")
    refused.add_argument("--use-beam-search", action="store_true")
    refused.add_argument("--profile", action="store_true")


def refusals(args: argparse.Namespace) -> list[str]:
    problems = [f"--{name.replace('_', '-')}: the load generator does not send it"
                for name in ("top_p", "top_k", "min_p", "logprobs", "lora_modules") if getattr(args, name) is not None]
    problems += [f"--{name.replace('_', '-')} is not available" for name in ("use_beam_search", "profile")
                 if getattr(args, name)]
    if args.tokenizer is not None:
        problems.append("--tokenizer: prompts are measured with the server's own tokenizer (/tokenize)")
    problems += [f"--metadata {item}: expected KEY=VALUE" for item in args.metadata or [] if "=" not in item]
    if args.dataset_name in OTHER_DATASETS:
        problems.append(f"--dataset-name {args.dataset_name}: not available; use one of {', '.join(DATASETS)}")
    return problems


def base_url(args: argparse.Namespace) -> str:
    """The server's root: loadgen adds the /v1 paths itself."""
    url = args.base_url or f"http://{args.host}:{args.port}"
    return url.rstrip("/").removesuffix("/v1")


def endpoint(args: argparse.Namespace) -> str:
    kind = BACKENDS[args.backend]
    if args.endpoint is None:
        return kind
    path = "/" + args.endpoint.strip("/")
    if path not in (COMPLETIONS_ENDPOINT, CHAT_ENDPOINT):
        raise RefusedFlag(f"--endpoint {args.endpoint}: only {COMPLETIONS_ENDPOINT} and {CHAT_ENDPOINT}")
    asked = "chat" if path == CHAT_ENDPOINT else "completions"
    if args.backend == "openai-chat" and asked != "chat":
        raise RefusedFlag(f"--backend openai-chat sends chat completions, not to --endpoint {args.endpoint}")
    return asked


def length_range(length: int, ratio: float, flag: str) -> str:
    """`--random-input-len 100 --random-range-ratio 0.5` -> "50:150" (loadgen draws uniformly)."""
    if length < 1:
        raise RefusedFlag(f"{flag} must be at least 1, got {length}")
    if not 0 <= ratio < 1:
        raise RefusedFlag(f"--random-range-ratio must be in [0, 1), got {ratio}")
    low, high = max(1, math.floor(length * (1 - ratio))), math.ceil(length * (1 + ratio))
    return str(low) if low == high else f"{low}:{high}"


def _dataset_argv(args: argparse.Namespace) -> list[str]:
    ratio = args.random_range_ratio
    if args.dataset_name == "random":
        argv = ["--input-len", length_range(args.random_input_len, ratio, "--random-input-len"),
                "--output-len", length_range(args.random_output_len, ratio, "--random-output-len")]
        if args.random_prefix_len > 0:
            argv = ["--workload", "shared-prefix", "--num-prefixes", "1", "--prefix-len",
                    str(args.random_prefix_len)] + argv
        return argv
    if args.dataset_name == "prefix_repetition":
        return ["--workload", "shared-prefix",
                "--num-prefixes", str(args.prefix_repetition_num_prefixes),
                "--prefix-len", length_range(args.prefix_repetition_prefix_len, 0, "--prefix-repetition-prefix-len"),
                "--input-len", length_range(args.prefix_repetition_suffix_len, 0, "--prefix-repetition-suffix-len"),
                "--output-len", length_range(args.prefix_repetition_output_len, 0, "--prefix-repetition-output-len")]
    if args.dataset_path is None:
        raise RefusedFlag(f"--dataset-name {args.dataset_name} needs --dataset-path FILE")
    output_len = args.sharegpt_output_len if args.dataset_name == "sharegpt" else args.custom_output_len
    argv = ["--dataset", args.dataset_path]
    if output_len is not None and output_len != -1:
        argv += ["--output-len", length_range(output_len, 0, f"--{args.dataset_name}-output-len")]
    return argv


def _goodput_argv(goodput: list[str] | None) -> list[str]:
    if not goodput:
        return []
    slos = []
    for item in goodput:
        name, _, value = item.partition(":")
        if name not in GOODPUT_NAMES or not value:
            raise RefusedFlag(f"--goodput {item}: expected NAME:MS with NAME in {', '.join(GOODPUT_NAMES)}")
        slos.append(f"{GOODPUT_NAMES[name]}={value}")
    return ["--slo", ",".join(slos)]


def loadgen_argv(args: argparse.Namespace, api_key: str | None = None) -> list[str]:
    """The loadgen command line of these flags; RefusedFlag names what cannot be translated."""
    if args.num_prompts < 1:
        raise RefusedFlag(f"--num-prompts must be at least 1, got {args.num_prompts}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise RefusedFlag(f"--max-concurrency must be at least 1, got {args.max_concurrency}")
    if not args.request_rate > 0 or not args.burstiness > 0:
        raise RefusedFlag(f"--request-rate and --burstiness must be > 0, got {args.request_rate} and {args.burstiness}")
    argv = ["--url", base_url(args), "--endpoint", endpoint(args), "--num-requests", str(args.num_prompts),
            "--seed", str(args.seed), "--temperature", str(args.temperature),
            "--ignore-eos" if args.ignore_eos else "--no-ignore-eos", "--percentiles", args.metric_percentiles]
    model = args.served_model_name or args.model
    if model is not None:
        argv += ["--model", model]
    if api_key:
        argv += ["--api-key", api_key]
    if not math.isinf(args.request_rate):
        argv += ["--request-rate", str(args.request_rate), "--burstiness", str(args.burstiness)]
    # At an unbounded rate vLLM sends every request at once: as many in flight as there are.
    concurrency = args.max_concurrency or (args.num_prompts if math.isinf(args.request_rate) else None)
    if concurrency is not None:
        argv += ["--concurrency", str(concurrency)]
    argv += _dataset_argv(args) + _goodput_argv(args.goodput)
    if args.disable_tqdm:
        argv.append("--no-progress")
    return argv


def metrics(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in METRICS]
    if unknown or not names:
        raise RefusedFlag(f"--percentile-metrics {text}: choose from {','.join(METRICS)}")
    return names


def run(args: argparse.Namespace) -> int:
    """One benchmark run; 0 when a request succeeded, 1 when none did, 2 for refused flags."""
    import asyncio

    from spillway.gateway.cli.bench_serve_report import format_result, save_result
    from spillway.tools.loadgen import cli as loadgen

    problems = refusals(args)
    try:
        if problems:  # the first of them is what to fix; a translation would add noise
            raise RefusedFlag(problems.pop())
        argv = loadgen_argv(args, os.environ.get("OPENAI_API_KEY"))
        shown = metrics(args.percentile_metrics)
        loadgen.parse_percentiles(args.metric_percentiles)
        loadgen_args = loadgen.build_parser().parse_args(argv)
        settings = loadgen.resolve(loadgen_args, argv)
    except (RefusedFlag, ValueError) as exc:
        problems.append(str(exc))
    except argparse.ArgumentTypeError as exc:
        problems.append(f"--metric-percentiles: {exc}")
    if problems:
        for problem in problems:
            print(f"spillway bench serve: {problem}", file=sys.stderr)
        return 2
    try:
        document = asyncio.run(loadgen.run(loadgen_args, settings))
    except KeyboardInterrupt:
        print("spillway bench serve: interrupted; no results", file=sys.stderr)
        return 130
    print(format_result(document, args, shown))
    if args.save_result:
        print(f"results written to {save_result(document, args, shown)}")
    return 0 if document["summary"]["num_ok"] > 0 else 1

