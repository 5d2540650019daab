"""The gateway's intake of one token-id prompt, timed piece by piece in-process: what the event
loop spends on a /v1/completions body between reading it and handing its Generate to the link.

    python tools/bench/serve/intake.py                           # this tree, 10,000-id prompts
    python tools/bench/serve/intake.py --baseline DIR            # and a tree at DIR, alternating, same run
                                                           #   (mkdir DIR && git archive REV | tar -x -C DIR)

Pieces (each the best of `--rounds` timeit rounds, microseconds per request): the body decoded
into its Struct (gateway/api/openai.py), the Job built from it (gateway/generation/jobs.py: checks, the ids'
range, their packing where the tree packs there), the ids packed for the wire where the Job
left them unpacked and the prefix block hashes (gateway/generation/serving.py's start), and the Generate
encoded (gateway/link/worker_link.py's send). tools/bench/serve/gateway_alone.py measures the whole served path.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import timeit
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

from spillway.tools.bench.serve.gateway_alone import tree_env  # noqa: E402
from spillway.tools.bench.result_rows import print_tree_medians, runs_of_trees  # noqa: E402

PIECES = ("decode", "job", "pack_and_hash", "encode", "total")


def time_pieces(prompt_len: int, rounds: int) -> dict[str, float]:
    """The child: microseconds per request of each piece, with whichever spillway it imports."""
    import msgspec

    from spillway.gateway.api import openai as api
    from spillway.gateway.generation.jobs import JobBuilder
    from spillway.gateway.api.sampling_params import SamplingParams
    from spillway.gateway.text.tokenizer import PromptHasher
    from spillway.protocol.hashing import pack_token_ids
    from spillway.protocol.messages import PROTOCOL_VERSION, Generate, Ready, encoder

    ready = Ready(protocol_version=PROTOCOL_VERSION, model="bench", block_size=16, hash_seed=b"spillway-v1",
                  num_gpu_blocks=4096, num_cpu_blocks=0, max_model_len=32768, max_num_seqs=256,
                  max_num_batched_tokens=8192, vocab_size=49152, eos_token_ids=[2], device="cpu", dtype="float32")
    builder = JobBuilder(None, ["bench"], lambda: ready)
    hasher = PromptHasher.of(ready)
    wire = encoder()
    rng = random.Random(1)
    ids = [rng.randrange(256, 49152) for _ in range(prompt_len)]  # random text, as gateway_alone.py's prompts
    body = msgspec.json.encode({"model": "bench", "prompt": ids, "max_tokens": 4, "stream": True,
                                "stream_options": {"include_usage": True, "continuous_usage_stats": True}})

    def decode():
        return api.decode_request(body, api.CompletionRequest)

    def job():
        return finished(builder.completion_job(decode()))

    built = job()
    prompt = built.prompts[0]

    def pack_and_hash():
        packed = getattr(prompt, "packed", None)  # a tree without packing on intake packs here
        packed = packed if packed is not None else pack_token_ids(prompt.token_ids)
        return packed, hasher(packed)

    packed, hashes = pack_and_hash()
    generate = Generate(request_id=f"cmpl-{'0' * 32}-0-0", prompt_token_ids=packed, block_hashes=hashes,
                        params=SamplingParams(max_tokens=4).to_wire(4, None))
    times = {}
    for name, fn in (("decode", decode), ("job", job), ("pack_and_hash", pack_and_hash),
                     ("encode", lambda: wire.encode(generate))):
        number = max(1, int(0.05 / max(timeit.timeit(fn, number=1), 1e-6)))
        best = min(timeit.repeat(fn, number=number, repeat=rounds)) / number
        times[name] = best * 1e6
    times["job"] -= times["decode"]  # job() decodes too
    times["total"] = sum(times[name] for name in PIECES[:-1])
    return times


def finished(coroutine):
    """The value of a coroutine that never suspends (building a Job from token ids awaits
    nothing): what the event loop runs of it in one piece."""
    try:
        coroutine.send(None)
    except StopIteration as done:
        return done.value
    coroutine.close()
    raise RuntimeError("the coroutine suspended")


def measure(tree: Path | None, args) -> dict[str, float]:
    command = [sys.executable, __file__, "--child", "--prompt-len", str(args.prompt_len), "--rounds", str(args.rounds)]
    done = subprocess.run(command, env=tree_env(tree), capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-len", type=int, default=10_000)
    parser.add_argument("--baseline", type=Path, help="a source tree to compare against, in the same run")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each tree, alternating")
    parser.add_argument("--rounds", type=int, default=7, help="timeit rounds per piece (the best counts)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.prompt_len < 1 or args.repeats < 1 or args.rounds < 1:
        parser.error("--prompt-len, --repeats and --rounds must be at least 1")
    if args.child:
        print(json.dumps(time_pieces(args.prompt_len, args.rounds)))
        return 0
    runs = runs_of_trees(lambda tree: measure(tree, args), args.baseline, args.repeats)
    title = (f"one {args.prompt_len}-id prompt on /v1/completions, us per request (median of {args.repeats} runs); "
             f"machine: {os.cpu_count()} CPUs")
    print_tree_medians(title, runs, PIECES, width=13)
    return 0


if __name__ == "__main__":
    sys.exit(main())
