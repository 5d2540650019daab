"""What CURVE costs the worker link: messages per second through a PUSH -> PULL pair over
loopback TCP, plain and CURVE-encrypted (protocol/local/link_auth.py), for the link's own messages.

    python tools/bench/serve/link.py                 # 20,000 messages of each kind
    python tools/bench/serve/link.py --messages 100000

Kinds: a decode step's StepOutputs for 64 requests (worker -> gateway, once per step) and a
Generate of a 2,000-token prompt (gateway -> worker, once per request). Each row sends the
encoded bytes as the link does (one frame per message) and counts until the last arrives.
"""

from __future__ import annotations

import argparse
import os
import threading
import time

import zmq


from spillway.protocol.local.link_auth import LinkKeys  # noqa: E402
from spillway.protocol.messages import (  # noqa: E402
    Generate,
    RequestDelta,
    SamplingParams,
    StepOutputs,
    encoder,
)


def messages() -> dict[str, bytes]:
    enc = encoder()
    step = StepOutputs(step=1, outputs=[RequestDelta(request_id=f"chatcmpl-{i:032x}-0", new_token_ids=[1234])
                                        for i in range(64)])
    generate = Generate(request_id="chatcmpl-" + "0" * 32 + "-0", prompt_token_ids=list(range(1000, 3000)),
                        block_hashes=[os.urandom(16) for _ in range(125)], params=SamplingParams(max_tokens=256))
    return {"StepOutputs x64": enc.encode(step), "Generate 2k tokens": enc.encode(generate)}


def rate(payload: bytes, count: int, keys: LinkKeys | None) -> float:
    ctx = zmq.Context()
    try:
        pull = ctx.socket(zmq.PULL)
        push = ctx.socket(zmq.PUSH)
        if keys is not None:
            keys.secure_gateway_socket(pull)
            keys.secure_worker_socket(push)
        port = pull.bind_to_random_port("tcp://127.0.0.1")
        push.connect(f"tcp://127.0.0.1:{port}")
        push.send(b"warm-up")
        pull.recv()

        def send() -> None:
            for _ in range(count):
                push.send(payload)

        sender = threading.Thread(target=send)
        started = time.perf_counter()
        sender.start()
        for _ in range(count):
            pull.recv()
        elapsed = time.perf_counter() - started
        sender.join()
        return count / elapsed
    finally:
        ctx.destroy(linger=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=3, help="best of this many runs per row")
    args = parser.parse_args()
    keys = LinkKeys.from_secret(os.urandom(32).hex().encode())
    print(f"{'message':<20} {'bytes':>7} {'plain msg/s':>12} {'CURVE msg/s':>12} {'CURVE MB/s':>11}")
    for name, payload in messages().items():
        plain = max(rate(payload, args.messages, None) for _ in range(args.repeats))
        curve = max(rate(payload, args.messages, keys) for _ in range(args.repeats))
        print(f"{name:<20} {len(payload):>7} {plain:>12,.0f} {curve:>12,.0f} {curve * len(payload) / 1e6:>11.1f}")


if __name__ == "__main__":
    main()
