"""The worker's memory under tools/soak/served.py's generation traffic, without a server: one `Engine`
driven in this process, its memory read every `--every` finished requests.

    python tools/soak/engine.py                           # default model, 300 requests, 2 in flight
    python tools/soak/engine.py --requests 600 --model PATH

Each line gives the resident set (RSS), the `[heap]` mapping's resident part (glibc's main
heap: what steps allocate and free), and malloc's bytes in use and held free (glibc's
`mallinfo2`). Growth in use is something kept; growth held free with in use flat is the
allocator's fragmentation. A step size met for the first time can add to either: `shapes`, the
distinct (row count, weight shape) pairs the packed linear layers ran (CPU only), says when.

The requests follow tools/soak/traffic.py's generation kinds and weights: prompts of PROMPT_WORDS words
(about ESTIMATED_TOKENS_PER_WORD tokens each, random ids), chat ones behind a shared template
prefix, OUTPUT_TOKENS tokens (EOS ignored, so lengths are as drawn), temperature 0 or 0.8;
`abort` stops after ABORT_AFTER_EVENTS tokens and `stop` after a random count, as the gateway
aborts a stream whose client left or whose stop string matched. Stats are read every step.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import random
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


from spillway.tools.loadgen.corpus import ESTIMATED_TOKENS_PER_WORD, RANDOM_TOKEN_IDS  # noqa: E402
from spillway.tools.soak.memory import MB, parse_vm_rss  # noqa: E402
from spillway.tools.soak.traffic import ABORT_AFTER_EVENTS, MIX, OUTPUT_TOKENS, PROMPT_WORDS  # noqa: E402

GENERATION_KINDS = ("chat_stream", "completion_stream", "chat", "completion", "abort", "stop")
CHAT_PREFIX_TOKENS = 30  # about the default model's chat template before the message


@dataclass(slots=True, frozen=True)
class Spec:
    """One generation: its prompt's token count, output budget and when it is cut short."""

    chat: bool
    prompt_tokens: int
    max_tokens: int
    temperature: float
    cut_after: int | None  # tokens received before the request is aborted; None: runs out


def specs(seed: int) -> Iterator[Spec]:
    """An endless seeded stream of generations, kinds drawn by traffic.MIX's weights."""
    rng = random.Random(seed)
    kinds, weights = zip(*((kind, weight) for kind, weight in MIX if kind in GENERATION_KINDS))
    while True:
        kind = rng.choices(kinds, weights)[0]
        chat = kind.startswith("chat") or (kind in ("abort", "stop") and rng.random() < 0.5)
        max_tokens = OUTPUT_TOKENS[1] if kind == "abort" else rng.randint(*OUTPUT_TOKENS)
        cut_after = {"abort": rng.randint(*ABORT_AFTER_EVENTS), "stop": rng.randint(1, max_tokens)}.get(kind)
        words = rng.randint(*PROMPT_WORDS)
        prompt_tokens = max(1, round(words * ESTIMATED_TOKENS_PER_WORD)) + (CHAT_PREFIX_TOKENS if chat else 0)
        yield Spec(chat, prompt_tokens, max_tokens, rng.choice((0.0, 0.8)), cut_after)


def prompt_ids(spec: Spec, rng: random.Random) -> list[int]:
    """Random ids; a chat prompt starts with the same prefix every time (its template's)."""
    prefix = list(range(RANDOM_TOKEN_IDS[0], RANDOM_TOKEN_IDS[0] + CHAT_PREFIX_TOKENS)) if spec.chat else []
    return prefix + [rng.randrange(*RANDOM_TOKEN_IDS) for _ in range(spec.prompt_tokens - len(prefix))]


def heap_resident_bytes(smaps: str) -> int:
    """The `[heap]` mapping's resident bytes, from the text of /proc/PID/smaps (0 without one)."""
    in_heap, total = False, 0
    for line in smaps.splitlines():
        fields = line.split()
        if fields and not fields[0].endswith(":"):  # a mapping's header: address range first
            in_heap = fields[-1] == "[heap]"
        elif in_heap and fields[0] == "Rss:":
            total += int(fields[1]) * 1024
    return total


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]


def malloc_bytes() -> tuple[int, int] | None:
    """glibc malloc's bytes in use and held free in its arenas; None off glibc 2.33+."""
    mallinfo2 = getattr(ctypes.CDLL(None), "mallinfo2", None)
    if mallinfo2 is None:
        return None
    mallinfo2.restype = _MallInfo2
    info = mallinfo2()
    return info.uordblks, info.fordblks


def memory_line(done: int, elapsed_s: float, num_shapes: int) -> str:
    rss = parse_vm_rss(Path("/proc/self/status").read_text())
    heap = heap_resident_bytes(Path("/proc/self/smaps").read_text())
    counters = malloc_bytes()
    in_use, held = ("n/a", "n/a") if counters is None else (f"{b / MB:,.1f}" for b in counters)
    return (f"{done:>9,} {elapsed_s:>8.0f} {rss / MB:>10,.1f} {heap / MB:>9,.1f} {in_use:>13} "
            f"{held:>11} {num_shapes:>7}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python tools/soak/engine.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=300, help="generations to finish (default 300)")
    parser.add_argument("--concurrency", type=int, default=2, help="generations in flight (default 2)")
    parser.add_argument("--every", type=int, default=25, help="finished requests between lines (default 25)")
    parser.add_argument("--seed", type=int, default=0, help="the traffic's seed")
    parser.add_argument("--model", help="the model (default: the default model)")
    return parser


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    for flag in ("requests", "concurrency", "every"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be >= 1, got {getattr(args, flag)}")
    return args


def run(args: argparse.Namespace) -> None:
    """Load the engine, then keep `--concurrency` generations in flight until `--requests` end."""
    from spillway.gateway.link.engine_args import engine_config
    from spillway.protocol.hashing import block_hashes
    from spillway.protocol.messages import Generate, SamplingParams
    from spillway.worker.driver.engine import Engine
    from spillway.worker.models.cpu_linear import PackedLinear, padded_rows

    engine = Engine(engine_config(args.model)[0])
    gc.collect()
    gc.freeze()  # as the worker does after start-up
    shapes: set[tuple[int, int, int]] = set()  # (rows run, in, out) of the packed linear layers

    def record(layer: PackedLinear, inputs: tuple, _) -> None:
        shapes.add((padded_rows(inputs[0].numel() // layer.in_features), layer.in_features, layer.out_features))

    for module in engine.runner.model.modules():
        if isinstance(module, PackedLinear):
            module.register_forward_hook(record)
    generations, rng = specs(args.seed), random.Random(args.seed)
    live: dict[str, list] = {}  # request id -> [spec, tokens received]
    started, started_at, done = 0, time.monotonic(), 0
    print(f"{'requests':>9} {'seconds':>8} {'RSS MB':>10} {'heap MB':>9} {'malloc in use':>13} "
          f"{'malloc free':>11} {'shapes':>7}")
    print(memory_line(0, 0.0, 0), flush=True)
    while done < args.requests:
        while len(live) < args.concurrency and started < args.requests:
            spec, request_id = next(generations), f"soak-{started}"
            ids = prompt_ids(spec, rng)
            params = SamplingParams(max_tokens=spec.max_tokens, temperature=spec.temperature, ignore_eos=True)
            engine.add_request(Generate(request_id=request_id, prompt_token_ids=ids, params=params,
                                        block_hashes=block_hashes(ids, engine.block_size, engine.root_hash)))
            live[request_id] = [spec, 0]
            started += 1
        ended = []
        for delta in engine.step():
            entry = live[delta.request_id]
            entry[1] += len(delta.new_token_ids)
            cut = entry[0].cut_after is not None and entry[1] >= entry[0].cut_after
            if delta.finish_reason is not None or cut:
                ended.append(delta.request_id)
        engine.stats()
        engine.abort(ended)  # the ones cut short; finished ones are no longer known
        for request_id in ended:
            del live[request_id]
            done += 1
            if done % args.every == 0:
                print(memory_line(done, time.monotonic() - started_at, len(shapes)), flush=True)


if __name__ == "__main__":
    run(parse_args(sys.argv[1:]))
