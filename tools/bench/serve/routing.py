"""What routing a request over data-parallel replicas costs the gateway, against what it already
spends on the same prompt: the prefix block hashes it computes for every request.

    python tools/bench/serve/routing.py                      # 10,000-token prompts, 4 replicas

Each replica's cache index holds `--held-blocks` blocks (KvEvents applied), among them the
prompt's first half on one replica; `--in-flight` requests' prompts are routed and not yet done.
Rows (microseconds per request, best of `--rounds` timeit rounds): `hash`, the prompt's block
hashes (gateway/text/tokenizer.py PromptHasher, the baseline); `route`, Router.choose with the
prefix policy plus the index's route and unroute of the request's blocks (what ReplicaSet adds
per request); and their ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import timeit


def measure(args) -> dict:
    from spillway.gateway.replicas.router import Router
    from spillway.protocol.hashing import DEFAULT_HASH_SEED, pack_token_ids, root_hash
    from spillway.gateway.text.tokenizer import PromptHasher
    from spillway.protocol.messages import KvEvents

    rng = random.Random(0)
    hasher = PromptHasher(16, root_hash(DEFAULT_HASH_SEED, "model"))
    prompt = pack_token_ids([rng.randrange(50_000) for _ in range(args.prompt_len)])
    hashes = hasher(prompt)
    router = Router("prefix", args.replicas, max_num_seqs=256)
    for replica in range(args.replicas):
        others = [os.urandom(16) for _ in range(args.held_blocks)]
        mine = hashes[: len(hashes) // 2] if replica == 1 else []
        router.index.apply(replica, KvEvents(stored=mine + others, removed=[]))
    for _ in range(args.in_flight):
        router.index.route(rng.randrange(args.replicas), [os.urandom(16) for _ in range(len(hashes))])
    loads, eligible = [10] * args.replicas, [True] * args.replicas

    def route() -> None:
        replica, _ = router.choose(hashes, loads, eligible)
        router.index.route(replica, hashes)
        router.index.unroute(replica, hashes)

    assert router.choose(hashes, loads, eligible)[0] == 1  # the half-prefix replica wins
    timings = {}
    for name, call in (("hash", lambda: hasher(prompt)), ("route", route)):
        best = min(timeit.repeat(call, number=args.number, repeat=args.rounds))
        timings[name] = round(best / args.number * 1e6, 2)
    return dict(prompt_len=args.prompt_len, replicas=args.replicas, held_blocks=args.held_blocks,
                in_flight=args.in_flight, hash_us=timings["hash"], route_us=timings["route"],
                route_over_hash=round(timings["route"] / timings["hash"], 3))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-len", type=int, default=10_000)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--held-blocks", type=int, default=100_000, help="blocks each replica holds")
    parser.add_argument("--in-flight", type=int, default=256)
    parser.add_argument("--number", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    print(json.dumps(measure(args)))


if __name__ == "__main__":
    main()
