"""A stand-in worker process for gateway tests: speaks the real protocol over the real
sockets, but "generates" by replaying a fixed token sequence, one token per step.

Its KV usage is one block per running request, so tests can see usage return to zero. Every
prompt block it is sent stays cached (reported as KvEvents when the config asks for them). Steps
start `step_s` apart while requests run (a message arriving ends the wait early, as a real
worker's poll does), so it also stands in for an engine of a known rate: every running request
gets one token per step (tools/bench/serve/gateway_alone.py drives the gateway alone with it). With
`hold_s`, a request that arrives at an idle worker starts a hold: no step runs until `hold_s`
after it, and whatever arrives meanwhile joins the first step (a shared prefix being loaded
from the CPU tier, as the convoy row of tools/bench/tier/served.py has it). With `beat`, it beats as
the real worker does (worker/heartbeat.py); with `stall_s`, its first step holds the loop that
long (a prefill of thousands of tokens on a CPU, a first step that compiles).

With `config.kv_transfer` it reports its role in Ready, a producer a KV server's address
(`fake_kv_address`, nothing listens there), and counts KV bytes as if every block of a Generate
with `kv_source` were pulled (received) and every prompt block it prefilled were served (sent),
`KV_BLOCK_BYTES` each. With `record_path`, every Generate and Abort it takes is a JSON line there
(`recorded`): what a test of the gateway's side of disaggregation checks.
"""

from __future__ import annotations

import json
import os
import sys
import time

import msgspec
import zmq

from spillway.gateway.link.worker_process import WorkerProcess
from spillway.protocol.config import WorkerConfig, exit_when_gateway_closes, read_launch
from spillway.protocol.local.link_auth import LinkKeys, connect_sockets
from spillway.protocol.hashing import unpack_token_ids
from spillway.protocol.messages import (
    PROTOCOL_VERSION,
    Abort,
    Control,
    ControlCommand,
    FinishReason,
    Generate,
    KvEvents,
    KvSourceLost,
    Ready,
    RequestDelta,
    Stats,
    StepOutputs,
    TokenLogprobs,
    encoder,
    gateway_decoder,
    worker_decoder,
)
from spillway.worker.heartbeat import Heartbeat

NUM_BLOCKS = 64
KV_BLOCK_BYTES = 4096


def fake_kv_address(pid: int) -> str:
    return f"ipc:///tmp/spillway-fake-kv-{pid}"


def recorded(path) -> list[dict]:
    """The messages a worker with `record_path` took, in order: {"generate": request_id,
    "max_tokens", "min_tokens", "ignore_eos", "logprobs", "kv_source", "block_hashes", "thinking"}
    or {"abort": [request ids]} or {"kv_source_lost": address}."""
    try:
        with open(path) as f:
            return [json.loads(line) for line in f]
    except FileNotFoundError:
        return []


def _record(file, message) -> None:
    if file is None:
        return
    match message:
        case Generate(params=params):
            entry = {"generate": message.request_id, "max_tokens": params.max_tokens,
                     "min_tokens": params.min_tokens, "ignore_eos": params.ignore_eos, "logprobs": params.logprobs,
                     "structured": params.structured is not None, "thinking": message.thinking is not None,
                     "kv_source": message.kv_source.address if message.kv_source is not None else None,
                     "block_hashes": len(message.block_hashes), "parent_id": message.parent_id}
        case Abort(request_ids=ids):
            entry = {"abort": list(ids)}
        case KvSourceLost(address=address):
            entry = {"kv_source_lost": address}
        case _:
            return
    file.write(json.dumps(entry) + "\n")


def fake_worker_main(config_bytes: bytes, inbox: str, outbox: str, script: list[int], step_s: float,
                     eos_token_id: int, vocab_size: int, worker_key: bytes | None = None,
                     arrivals_path: str | None = None, hold_s: float = 0.0, beat: bool = False,
                     stall_s: float = 0.0, record_path: str | None = None) -> None:
    config = msgspec.msgpack.decode(config_bytes, type=WorkerConfig)
    kv = config.kv_transfer
    ctx = zmq.Context()
    # The real worker's sockets, CURVE clients when given the link's secret.
    keys = LinkKeys.from_secret(worker_key) if worker_key else None
    inp, out = connect_sockets(ctx, inbox, outbox, keys)
    enc, dec = encoder(), gateway_decoder()
    ready = Ready(
        protocol_version=PROTOCOL_VERSION, model=config.served_model_name or "fake", block_size=config.block_size,
        hash_seed=config.hash_seed, num_gpu_blocks=NUM_BLOCKS, num_cpu_blocks=0,
        max_model_len=config.max_model_len or 256, max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=512, vocab_size=vocab_size, eos_token_ids=[eos_token_id], device="cpu",
        dtype="float32", worker_session=os.urandom(8), kv_role=kv.kv_role if kv is not None else "",
        kv_address=fake_kv_address(os.getpid()) if kv is not None and kv.produces else "")
    out.send(enc.encode(ready))
    heartbeat = Heartbeat(ctx, [outbox], keys).start() if beat else None
    gateway_session = None
    running: dict[str, tuple[Generate, int, int]] = {}  # (request, cached tokens, produced)
    queries = hits = 0
    checked = False  # a CHECK_INVARIANTS waits for the next report
    seen_hashes: set[bytes] = set()
    stored: list[bytes] = []  # with config.kv_events: prompt blocks first seen since the last report
    # Each Generate's arrival (time.monotonic(), a line each): when a burst's requests got through the gateway.
    arrivals = open(arrivals_path, "a", buffering=1) if arrivals_path else None
    record = open(record_path, "a", buffering=1) if record_path else None
    kv_bytes = {"received": 0, "sent": 0}
    received: dict[str, float] = {}  # until the request's first step: its queue time
    step = 0
    last_stats = 0.0
    last_step = time.monotonic()
    hold_until = 0.0
    while True:
        if heartbeat is not None:
            heartbeat.stage_started()
        pending: list[RequestDelta] = []
        want_stats = False
        # Paced from the last step's start, so the rate does not depend on the step's own work.
        next_step = max(last_step + step_s, hold_until)
        timeout = max(0.0, next_step - time.monotonic()) * 1000 if running else 1000
        while inp.poll(timeout):
            timeout = 0
            message = dec.decode(inp.recv())
            _record(record, message)
            match message:
                case Generate() as msg:
                    if msg.kv_source is not None:
                        kv_bytes["received"] += len(msg.block_hashes) * KV_BLOCK_BYTES
                    cached = 0
                    for h in msg.block_hashes:
                        if h not in seen_hashes:
                            break
                        cached += config.block_size
                    queries += len(unpack_token_ids(msg.prompt_token_ids))
                    hits += cached
                    if config.kv_events:
                        stored += [h for h in msg.block_hashes if h not in seen_hashes]
                    seen_hashes.update(msg.block_hashes)
                    if not running:
                        hold_until = time.monotonic() + hold_s
                    running[msg.request_id] = (msg, cached, 0)
                    received[msg.request_id] = time.monotonic()
                    if arrivals is not None:
                        arrivals.write(f"{received[msg.request_id]}\n")
                case Abort(request_ids=ids):
                    for rid in ids:
                        if running.pop(rid, None) is not None:
                            pending.append(RequestDelta(request_id=rid, new_token_ids=[],
                                                        finish_reason=FinishReason.ABORT))
                case Control(command=ControlCommand.SHUTDOWN):
                    if heartbeat is not None:
                        heartbeat.stop()
                    return
                case Control(command=ControlCommand.HELLO, session=session):
                    if session != gateway_session:  # as the real worker: the old gateway's work is dropped
                        running.clear()
                        pending.clear()
                        gateway_session = session
                        out.send(enc.encode(ready))
                case Control(command=ControlCommand.CHECK_INVARIANTS):
                    want_stats = checked = True  # as the real worker: this report says the check held
                case Control():
                    want_stats = True
        held = time.monotonic() < hold_until  # nothing steps before the hold ends
        was_busy = bool(running) and not held
        if was_busy:
            if heartbeat is not None:
                heartbeat.stage_started()
            if stall_s:
                time.sleep(stall_s)  # deaf to the inbox, as a real step is
                stall_s = 0.0
            last_step = time.monotonic()
        for rid, (msg, cached, produced) in list(running.items()) if was_busy else ():
            token = script[produced % len(script)]
            produced += 1
            done = produced >= msg.params.max_tokens
            logprobs = None
            if msg.params.logprobs is not None:
                top = list(range(msg.params.logprobs))
                logprobs = [TokenLogprobs(token, -0.5, 1, top, [-0.5 - i for i in top])]
            first = produced == 1
            prompt_logprobs = None
            if first and msg.params.prompt_logprobs is not None:  # each prompt token as the likeliest
                top = list(range(msg.params.prompt_logprobs))
                prompt_logprobs = [TokenLogprobs(t, -0.25, 1, top, [-0.25 - i for i in top])
                                   for t in unpack_token_ids(msg.prompt_token_ids)[1:]]
            pending.append(RequestDelta(
                request_id=rid, new_token_ids=[token], logprobs=logprobs,
                finish_reason=FinishReason.LENGTH if done else None,
                num_cached_tokens=cached if first else -1, prompt_logprobs=prompt_logprobs,
                queued_s=last_step - received.pop(rid) if first else -1.0))
            if done:
                del running[rid]
                if kv is not None and kv.produces and msg.kv_source is None:
                    kv_bytes["sent"] += len(msg.block_hashes) * KV_BLOCK_BYTES
            else:
                running[rid] = (msg, cached, produced)
        now = time.monotonic()
        if was_busy and (not running or now - last_stats > 0.5):
            want_stats = True
        if pending or want_stats or stored:
            stats = None
            if want_stats:
                last_stats = now
                stats = Stats(num_running=len(running), gpu_cache_usage=len(running) / NUM_BLOCKS,
                              num_gpu_blocks=NUM_BLOCKS, num_free_gpu_blocks=NUM_BLOCKS - len(running),
                              prefix_cache_queries=queries, prefix_cache_hits=hits, num_steps=step,
                              invariants_ok=True if checked else None,
                              kv_transfer_bytes_received=kv_bytes["received"], kv_transfer_bytes_sent=kv_bytes["sent"],
                              kv_transfer_seconds_received=kv_bytes["received"] / 1e9,
                              kv_transfer_seconds_sent=kv_bytes["sent"] / 1e9)
                checked = False
            events, stored = (KvEvents(stored=stored, removed=[]) if stored else None), []
            out.send(enc.encode(StepOutputs(step=step, outputs=pending, stats=stats, kv_events=events)))
            step += 1


class FakeWorkerProcess(WorkerProcess):
    """WorkerProcess's start, sockets and handshake, with this file's fake loop as the program."""

    def __init__(self, config: WorkerConfig, script: list[int], *, step_s: float = 0.005,
                 eos_token_id: int = 2, vocab_size: int = 49152, arrivals_path: str | None = None,
                 hold_s: float = 0.0, beat: bool = False, stall_s: float = 0.0, record_path: str | None = None) -> None:
        fake = json.dumps({"script": script, "step_s": step_s, "eos_token_id": eos_token_id, "vocab_size": vocab_size,
                           "arrivals_path": arrivals_path, "hold_s": hold_s, "beat": beat, "stall_s": stall_s,
                           "record_path": record_path})
        super().__init__(config, command=[sys.executable, __file__, fake])


if __name__ == "__main__":  # started by FakeWorkerProcess, as the real worker is: the launch on stdin
    launch = read_launch(sys.stdin.fileno())
    exit_when_gateway_closes(sys.stdin.fileno())
    fake_worker_main(msgspec.msgpack.encode(launch.config), launch.inbox, launch.outbox, **json.loads(sys.argv[1]))
