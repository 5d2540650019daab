"""Data-parallel replicas through `spillway serve -dp N`, measured by tools/loadgen, each figure
beside its baseline from the same run.

    python tools/bench/serve/replicas.py                  # the default model, sizes for a 2-core CPU
    python tools/bench/serve/replicas.py --model qwen3-8b --users 256 --turns 8 --input-len 100:400 \
        --output-len 50:200 --num-requests 1000 --input-len-uniform 1000 --output-len-uniform 1000 \
        --device-args "--kv-cache-dtype fp8" --rounds 2   # one GPU, two replicas sharing it

`--model` is a model folder, a .gguf file, or a built-in config (qwen3-8b, ...: dummy weights and
the default model's tokenizer, as tools/bench/serve/serve.py builds it; `--tokenizer-dir` where
the default model is not installed); left out, the default model. `--device-args` go to every
`spillway serve` after the tool's own flags, which they may override.

Rows (`--rows`, both by default), each server run once per round (`--rounds`), the order of the
servers reversed every other round so that none always goes first:
    routing  each policy of `--policies` (default prefix,load) on `spillway serve -dp 2 --routing
             POLICY`, every replica's KV pool (`--num-gpu-blocks-override`) holding `--pool-share`
             of all conversations' histories (the workload's mean lengths and the tokens the
             model's chat template adds; the line gives the histories as served over one pool),
             then loadgen multi-turn: `--users` conversations open at once, at most
             `--concurrency` requests in flight, `--turns` turns each, a user message of
             `--input-len` and a reply of `--output-len` tokens a turn, each user waiting
             `--think-time` seconds (mean) after a reply. A line: the server's prefix-cache hit
             rate (/metrics over all replicas; each replica's too, with the requests routed to
             it by reason), TTFT p50 of turns 2+. Summary: each policy's median over the rounds
             and the ratios against `--baseline-policy` (load): hit rate policy / baseline, TTFT
             p50 baseline / policy.
    uniform  `-dp 1` and `-dp 2` (the replicas share one GPU's memory, or the CPU's cores) on loadgen
             random: `--num-requests` prompts of `--input-len-uniform` tokens asking
             `--output-len-uniform`, all sent at once. A line: output tok/s. Summary: dp2 / dp1.

Every line is printed as a JSON line and appended to `--results`; `--output-dir` keeps each
run's loadgen JSON and printed summary and each server's log. Every server runs in a process
group of its own and is stopped on every way out: an error, Ctrl-C, SIGTERM (a caller's
timeout), and, through the parent-death signal, this process killed outright.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import date
from pathlib import Path

import httpx

from spillway.tools.bench.serve.replica_lines import (
    Counters, parse_engine_counters, replica_figures, routing_line, routing_summary, uniform_line, uniform_summary,
)
from spillway.tools.bench.serve.server_process import Server, default_tokenizer_dir, machine, temporary_model_folder
from spillway.tools.loadgen.workloads import Lengths

ROWS = ("routing", "uniform")
POLICIES = ("prefix", "load", "round-robin")
ROUTING_REPLICAS = 2


# ---- sizes ------------------------------------------------------------------------------------

def mean_tokens(lengths: Lengths) -> float:
    return (lengths.low + lengths.high) / 2


def history_tokens(args, template_tokens: int) -> float:
    """One conversation's tokens after its last turn, on average: the workload's lengths and the
    chat template's own tokens (`template_tokens`, `chat_template_tokens`)."""
    return args.turns * (mean_tokens(args.input_len) + mean_tokens(args.output_len)) + template_tokens


def pool_blocks(args, template_tokens: int) -> int:
    """Blocks of each replica's KV pool: `--pool-share` of every conversation's history."""
    return math.ceil(args.pool_share * args.users * history_tokens(args, template_tokens) / args.block_size)


def check_pool(args, template_tokens: int) -> None:
    """A pool must hold the longest conversation; SystemExit naming what to change."""
    longest = args.turns * (args.input_len.high + args.output_len.high) + template_tokens
    pool = pool_blocks(args, template_tokens) * args.block_size
    if longest > pool:
        raise SystemExit(f"one replica's pool ({pool} tokens) is shorter than the longest conversation "
                         f"({longest} tokens): raise --pool-share or --users, or lower --turns")


def chat_template_tokens(folder: Path, turns: int) -> int:
    """The tokens a `turns`-turn conversation's chat template adds to its messages' text (system
    prompt, role markers), from the model's own tokenizer: the template of empty messages."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    messages = [{"role": role, "content": ""} for _ in range(turns) for role in ("user", "assistant")][:-1]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


@dataclass(frozen=True, slots=True)
class Pool:
    """Each replica's KV pool in the routing row, and the chat template's share it was sized with."""

    blocks: int
    template_tokens: int

    @classmethod
    def sized(cls, args, template_tokens: int) -> Pool:
        check_pool(args, template_tokens)
        return cls(pool_blocks(args, template_tokens), template_tokens)


def policy_order(policies: list[str], rounds: int) -> list[tuple[int, str]]:
    """(round, policy) in run order: as given in even rounds, reversed in odd ones."""
    return [(r, p) for r in range(rounds) for p in (policies if r % 2 == 0 else policies[::-1])]


# ---- the server and the load ----------------------------------------------------------------

def model_folder(args, stack: contextlib.ExitStack) -> Path:
    """The folder `spillway serve` loads (a GGUF file's converted one): a built-in config becomes
    a folder of its config and the default model's tokenizer, kept until `stack` closes."""
    from spillway.protocol.local.model_files import builtin_config_names, resolve_model

    if args.model in builtin_config_names():
        folder, _ = stack.enter_context(temporary_model_folder(args.model, args.tokenizer_dir or default_tokenizer_dir()))
        return folder
    return resolve_model(args.model, args.load_format or "auto").path


def model_args(args, folder: Path) -> list[str]:
    """`spillway serve`'s model and load format: a built-in config's folder, with dummy weights;
    else `--model` as given (none: serve's default model)."""
    from spillway.protocol.local.model_files import builtin_config_names

    if args.model in builtin_config_names():
        return [str(folder), "--load-format", args.load_format or "dummy"]
    return [*([args.model] if args.model else []), *(["--load-format", args.load_format] if args.load_format else [])]


def serve_args(model: list[str], replicas: int, max_pending: int, args, extra: list[str]) -> list[str]:
    """Every flag of one `spillway serve`; `--device-args` last, so that they win."""
    return [*model, "--data-parallel-size", str(replicas), "--block-size", str(args.block_size),
            "--max-pending-requests", str(max_pending), *extra, *shlex.split(args.device_args)]


def routing_flags(policy: str, pool: Pool, args) -> list[str]:
    """The policy, and the pool: its blocks, and as many tokens a request at most."""
    return ["--routing", policy, "--num-gpu-blocks-override", str(pool.blocks),
            "--max-model-len", str(pool.blocks * args.block_size)]


def routing_workload(args, pool: Pool) -> dict:
    """The routing row's sizes, as every line of it gives them."""
    return dict(replicas=ROUTING_REPLICAS, users=args.users, concurrency=args.concurrency,
                think_time_s=args.think_time, turns=args.turns, input_len=str(args.input_len),
                output_len=str(args.output_len), pool_blocks=pool.blocks, block_size=args.block_size,
                chat_template_tokens=pool.template_tokens)


def multi_turn_load(args) -> list[str]:
    return ["--workload", "multi-turn", "--num-users", str(args.users), "--concurrency", str(args.concurrency),
            "--think-time", str(args.think_time), "--num-turns", str(args.turns), "--input-len", str(args.input_len),
            "--output-len", str(args.output_len), "--num-requests", str(args.users * args.turns)]


def uniform_load(args) -> list[str]:
    return ["--workload", "random", "--input-len", str(args.input_len_uniform),
            "--output-len", str(args.output_len_uniform), "--num-requests", str(args.num_requests),
            "--concurrency", str(args.num_requests)]


def run_loadgen(url: str, load: list[str], args, results: Path) -> dict:
    """tools/loadgen against `url`; its results document. Its printed summary goes beside it."""
    command = [sys.executable, "-m", "spillway.tools.loadgen", "--url", url, *load, "--seed", str(args.seed),
               "--timeout", str(args.timeout), "--no-progress", "--output", str(results)]
    with open(results.with_suffix(".txt"), "w") as printed:
        done = subprocess.run(command, stdout=printed, stderr=subprocess.STDOUT)
    if done.returncode != 0 or not results.is_file():
        raise SystemExit(f"loadgen failed ({done.returncode}): {results.with_suffix('.txt')}\n"
                         f"{results.with_suffix('.txt').read_text()[-2000:]}")
    return json.loads(results.read_text())


def engine_counters(url: str) -> Counters:
    return parse_engine_counters(httpx.get(url + "/metrics", timeout=10, trust_env=False).raise_for_status().text)


# ---- the rows -------------------------------------------------------------------------------

class Bench:
    """One invocation: the model's serve arguments, the routing row's pool, where runs are kept,
    and the lines so far."""

    def __init__(self, args, model: list[str], pool: Pool | None, out_dir: Path) -> None:
        self.args = args
        self.model = model
        self.pool = pool
        self.out_dir = out_dir
        self.stamp = dict(model=args.model or "default", machine=machine(), date=str(date.today()),
                          command=shlex.join([sys.argv[0].rpartition("/")[2], *sys.argv[1:]]))
        self.lines: list[dict] = []

    def emit(self, line: dict) -> dict:
        text = json.dumps(line)
        print(text, flush=True)
        if self.args.results:
            with open(self.args.results, "a") as out:
                out.write(text + "\n")
        self.lines.append(line)
        return line

    def served(self, name: str, flags: list[str]) -> Server:
        log(f"{name}: spillway serve {shlex.join(flags)}")
        return Server(flags, self.args.startup_timeout, keep_log=self.out_dir / f"server-{name}.log",
                      die_with_parent=True)

    def routing(self) -> None:
        args, lines = self.args, []
        assert self.pool is not None, "the routing row's pool is sized when the row is chosen"
        workload = routing_workload(args, self.pool)
        for round_index, policy in policy_order(args.policies, args.rounds):
            name = f"routing-{policy}-r{round_index}"
            flags = serve_args(self.model, ROUTING_REPLICAS, args.users, args, routing_flags(policy, self.pool, args))
            with self.served(name, flags) as server:
                before = engine_counters(server.url)
                document = run_loadgen(server.url, multi_turn_load(args), args, self.out_dir / f"loadgen-{name}.json")
                replicas = replica_figures(before, engine_counters(server.url))
            lines.append(self.emit(routing_line(policy, round_index, document, replicas, workload,
                                                self.pool.blocks * args.block_size, self.stamp)))
        self.emit(routing_summary(lines, args.baseline_policy, self.stamp))

    def uniform(self) -> None:
        args, lines = self.args, []
        workload = dict(input_len=args.input_len_uniform, output_len=args.output_len_uniform)
        for round_index, replicas in policy_order([1, 2], args.rounds):
            name = f"uniform-dp{replicas}-r{round_index}"
            with self.served(name, serve_args(self.model, replicas, args.num_requests, args, [])) as server:
                document = run_loadgen(server.url, uniform_load(args), args, self.out_dir / f"loadgen-{name}.json")
            lines.append(self.emit(uniform_line(replicas, round_index, document, workload, self.stamp)))
        self.emit(uniform_summary(lines, self.stamp))


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def run(args) -> list[dict]:
    """Every row of `args.rows`; the lines, as printed."""
    out_dir = Path(args.output_dir or tempfile.mkdtemp(prefix="replicas-bench-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        folder = model_folder(args, stack)
        pool = Pool.sized(args, chat_template_tokens(folder, args.turns)) if "routing" in args.rows else None
        bench = Bench(args, model_args(args, folder), pool, out_dir)
        rows = {"routing": bench.routing, "uniform": bench.uniform}
        for row in args.rows:
            rows[row]()
    log(f"loadgen results and server logs: {out_dir}")
    return bench.lines


# ---- the command line -----------------------------------------------------------------------

def _choices(allowed: tuple[str, ...]):
    def parse(text: str) -> list[str]:
        chosen = [part.strip() for part in text.split(",") if part.strip()]
        unknown = [part for part in chosen if part not in allowed]
        if unknown or not chosen or len(set(chosen)) != len(chosen):
            raise argparse.ArgumentTypeError(f"a comma-separated list of distinct {', '.join(allowed)}; got {text!r}")
        return chosen
    return parse


def _lengths(text: str) -> Lengths:
    try:
        return Lengths.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=_choices(ROWS), default=list(ROWS), help="routing, uniform or both")
    parser.add_argument("--model", help="a model folder, a .gguf file or a built-in config (default: the default model)")
    parser.add_argument("--load-format", help="as spillway serve's (default: its own; dummy for a built-in config)")
    parser.add_argument("--tokenizer-dir", type=Path, help="a built-in config's tokenizer (default: the default model's)")
    parser.add_argument("--device-args", default="", help="more `spillway serve` flags, e.g. '--kv-cache-dtype fp8'")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=1, help="runs of each server, the order reversed every other round")
    routing = parser.add_argument_group("routing row")
    routing.add_argument("--policies", type=_choices(POLICIES), default=["prefix", "load"],
                         help=f"comma-separated, of {', '.join(POLICIES)} (default prefix,load)")
    routing.add_argument("--baseline-policy", default="load", help="the policy the others are compared with")
    routing.add_argument("--users", type=int, default=24, help="conversations open at once")
    routing.add_argument("--concurrency", type=int, help="requests in flight at most (default: --users)")
    routing.add_argument("--think-time", type=float, default=1.0,
                         help="a user's mean wait in seconds after a reply (loadgen's --think-time). Without "
                              "one, a turn takes the slot its conversation's last turn just freed, on the least "
                              "loaded replica: the one that served that turn, so load routing keeps each "
                              "conversation on one replica as prefix routing does")
    routing.add_argument("--turns", type=int, default=4)
    routing.add_argument("--input-len", type=_lengths, default=Lengths(16, 64), help="user tokens a turn (N or LOW:HIGH)")
    routing.add_argument("--output-len", type=_lengths, default=Lengths(8, 32), help="reply tokens a turn (N or LOW:HIGH)")
    routing.add_argument("--pool-share", type=float, default=0.6,
                         help="of all histories, what each replica's KV pool holds (below 1: they outgrow one pool)")
    uniform = parser.add_argument_group("uniform row")
    uniform.add_argument("--num-requests", type=int, default=64, help="sent at once")
    uniform.add_argument("--input-len-uniform", type=int, default=128)
    uniform.add_argument("--output-len-uniform", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0, help="of the workloads (the same for every server)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds a request may take")
    parser.add_argument("--startup-timeout", type=float, default=600.0, help="seconds a server may take to start")
    parser.add_argument("--output-dir", help="keep every loadgen JSON and server log here (default: a temporary folder)")
    parser.add_argument("--results", help="append the JSON lines here too")
    return parser


def check_args(parser: argparse.ArgumentParser, args) -> None:
    args.concurrency = args.concurrency or args.users
    if args.think_time < 0:
        parser.error("--think-time must be >= 0")
    if min(args.users, args.concurrency, args.turns, args.rounds, args.num_requests, args.input_len_uniform,
           args.output_len_uniform, args.block_size) < 1:
        parser.error("--users, --concurrency, --turns, --rounds, --num-requests, the lengths and --block-size must be positive")
    if not 0 < args.pool_share:
        parser.error("--pool-share must be positive")
    if "routing" in args.rows and args.baseline_policy not in args.policies:
        parser.error(f"--baseline-policy {args.baseline_policy} is not among --policies")


def exit_on_sigterm() -> None:
    """SIGTERM (a caller's timeout) unwinds as an error does, through every `with` that stops a
    server; a second one is ignored, so that it cannot cut that clean-up short."""
    def unwind(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, unwind)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    exit_on_sigterm()
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
