"""The busy loop (worker/main.py) sending KV events, on the default model over inproc links: every
link hears each report once, whichever link the request came on; a gateway attaching anew gets
the whole set; a reset reaches the gateway as a clear; without `kv_events` no message has any."""

from __future__ import annotations

import threading

import pytest
import zmq
from kv_events_consumer import KvEventsConsumer

from spillway.protocol.config import WorkerConfig
from spillway.protocol.hashing import block_hashes
from spillway.protocol.local import model_files
from spillway.protocol.messages import (Control, ControlCommand, Generate, KvEvents, Ready, SamplingParams,
                                        StepOutputs, encoder, worker_decoder)
from spillway.worker.driver.engine import Engine
from spillway.worker.gateway_links import GatewayLinks
from spillway.worker.heartbeat import Heartbeat
from spillway.worker.main import _busy_loop

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
PROMPT = [(7 * i) % 500 + 10 for i in range(40)]  # two full blocks


class Gateways:
    """The gateway ends of `num_links` links to a busy loop run in a thread on `engine`."""

    def __init__(self, engine: Engine, num_links: int) -> None:
        self.engine = engine
        self.ctx = zmq.Context()
        self.pushes, self.pulls = [], []
        addresses = []
        for link in range(num_links):
            push, pull = self.ctx.socket(zmq.PUSH), self.ctx.socket(zmq.PULL)
            push.bind(f"inproc://kv-in-{link}")
            pull.bind(f"inproc://kv-out-{link}")
            self.pushes.append(push)
            self.pulls.append(pull)
            addresses.append((f"inproc://kv-in-{link}", f"inproc://kv-out-{link}"))
        links = GatewayLinks(self.ctx, addresses)
        beat = Heartbeat(self.ctx, [])  # never started: the loop only marks its stages
        self.thread = threading.Thread(target=_busy_loop, args=(engine, engine.ready(), links, None, beat))
        self.thread.start()
        self.enc, self.dec = encoder(), worker_decoder()
        self.received: list[list[object]] = [[] for _ in range(num_links)]
        self.looked_at = [0] * num_links  # of each link's messages, those a wait looked at

    def send(self, link: int, msg) -> None:
        self.pushes[link].send(self.enc.encode(msg))

    def generate(self, link: int, request_id: str, prompt: list[int]) -> None:
        self.send(link, Generate(request_id=request_id, prompt_token_ids=prompt,
                                 block_hashes=block_hashes(prompt, self.engine.block_size, self.engine.root_hash),
                                 params=GREEDY))

    def wait_for(self, link: int, done) -> None:
        """Read every link until `done(message)` holds for a message on `link` that no wait
        before this one looked at (reading one link, a wait may have read the other's)."""
        poller = zmq.Poller()
        for pull in self.pulls:
            poller.register(pull, zmq.POLLIN)
        while True:
            received = self.received[link]
            while self.looked_at[link] < len(received):
                self.looked_at[link] += 1
                if done(received[self.looked_at[link] - 1]):
                    return
            events = dict(poller.poll(30_000))
            assert events, "the busy loop went silent"
            for index, pull in enumerate(self.pulls):
                if pull in events:
                    self.received[index].append(self.dec.decode(pull.recv()))

    def stop(self) -> None:
        self.send(0, Control(ControlCommand.SHUTDOWN))
        self.thread.join(30)
        assert not self.thread.is_alive()
        for pull, received in zip(self.pulls, self.received):  # what was sent before the shutdown
            while pull.poll(0):
                received.append(self.dec.decode(pull.recv()))
        self.ctx.destroy(linger=0)

    def reports(self, link: int) -> list[KvEvents]:
        return [msg.kv_events for msg in self.received[link]
                if isinstance(msg, StepOutputs) and msg.kv_events is not None]


def finished(request_id: str):
    return lambda msg: isinstance(msg, StepOutputs) and any(
        delta.request_id == request_id and delta.finish_reason is not None for delta in msg.outputs)


def stats(msg) -> bool:
    return isinstance(msg, StepOutputs) and msg.stats is not None


def replayed(reports: list[KvEvents]) -> set[bytes]:
    consumer = KvEventsConsumer()
    for events in reports:
        consumer.apply(events)
    return consumer.held


def engine_for(kv_events: bool) -> Engine:
    return Engine(WorkerConfig(model=str(model_files.resolve_model(None).path), device="cpu", dtype="float32",
                               max_num_seqs=4, max_model_len=64, num_gpu_blocks_override=8, kv_events=kv_events),
                  defer_release=True)


@pytest.fixture(scope="module")
def engine():
    engine = engine_for(kv_events=True)
    yield engine
    engine.close()


def test_every_link_hears_each_report_once_and_a_reset_as_a_clear(engine):
    assert engine.reset_prefix_cache()  # the first report clears: a new gateway's view starts empty
    gateways = Gateways(engine, num_links=2)
    try:
        gateways.generate(1, "a", PROMPT)
        gateways.wait_for(1, finished("a"))
        gateways.generate(1, "b", PROMPT[:32] + [3, 1, 4, 1, 5, 9, 2, 6])
        gateways.wait_for(1, finished("b"))
        gateways.wait_for(0, stats)  # the worker went idle: every link hears its stats
    finally:
        gateways.stop()
    held = engine.block_manager.held_block_hashes()
    assert held == set(block_hashes(PROMPT, engine.block_size, engine.root_hash)[:2])
    reports = gateways.reports(1)
    assert gateways.reports(0) == reports  # link 0 had no outputs, and heard the same reports
    assert not any(msg.outputs for msg in gateways.received[0] if isinstance(msg, StepOutputs))
    assert reports[0].cleared and replayed(reports) == held

    gateways = Gateways(engine, num_links=1)
    try:
        gateways.send(0, Control(ControlCommand.RESET_PREFIX_CACHE))
        gateways.wait_for(0, stats)
    finally:
        gateways.stop()
    assert gateways.reports(0) == [KvEvents(stored=[], removed=[], cleared=True)]
    assert [msg for msg in gateways.received[0] if msg.kv_events is not None][0].stats is not None  # with the stats


def test_a_gateway_attaching_anew_gets_the_whole_set(engine):
    assert engine.reset_prefix_cache()
    gateways = Gateways(engine, num_links=2)
    try:
        gateways.generate(0, "c", PROMPT)
        gateways.wait_for(0, finished("c"))
        gateways.send(1, Control(ControlCommand.HELLO, session=b"new-gateway"))
        gateways.wait_for(1, lambda msg: isinstance(msg, Ready))
        gateways.wait_for(1, lambda msg: isinstance(msg, StepOutputs) and msg.kv_events is not None)
    finally:
        gateways.stop()
    at = next(index for index, msg in enumerate(gateways.received[1]) if isinstance(msg, Ready))
    snapshot = gateways.received[1][at + 1].kv_events  # right after its Ready, on the same socket
    held = engine.block_manager.held_block_hashes()
    assert held == set(block_hashes(PROMPT, engine.block_size, engine.root_hash)[:2])
    assert snapshot == KvEvents(stored=block_hashes(PROMPT, engine.block_size, engine.root_hash)[:2], removed=[],
                                cleared=True)
    assert replayed(gateways.reports(0)) == replayed(gateways.reports(1)) == held


def test_without_kv_events_no_message_carries_any():
    engine = engine_for(kv_events=False)
    gateways = Gateways(engine, num_links=1)
    try:
        gateways.generate(0, "a", PROMPT)
        gateways.wait_for(0, finished("a"))
        gateways.send(0, Control(ControlCommand.RESET_PREFIX_CACHE))
        gateways.wait_for(0, stats)
    finally:
        gateways.stop()
        engine.close()
    steps = [msg for msg in gateways.received[0] if isinstance(msg, StepOutputs)]
    assert steps and all(msg.kv_events is None for msg in steps)
