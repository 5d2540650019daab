"""The busy loop (worker/main.py) of a producer and of a consumer, each in a thread with an inproc
gateway link, their KV sockets polled with it: an idle producer answers a pull at once (not after
its idle poll), the consumer decodes the pulled prompt as one engine alone does, and a consumer
waiting for an answer that never comes waits in its poll, not in a spin, until the bound."""

from __future__ import annotations

import itertools
import threading
import time

import pytest
import zmq
from kv_transfer_pair import generate, run, tokens

from spillway.protocol.messages import Control, ControlCommand, FinishReason, Stats, StepOutputs, encoder, worker_decoder
from spillway.worker.driver.engine import Engine
from spillway.worker.gateway_links import GatewayLinks
from spillway.worker.heartbeat import Heartbeat
from spillway.worker.kv_transfer.links import KvLinks
from spillway.worker.main import IDLE_POLL_MS, _busy_loop

PROMPT = [(13 * i + 70) % 3000 + 100 for i in range(70)]
_names = itertools.count()


class Gateway:
    """The gateway end of one link to a busy loop run in a thread on `engine`, with its KV sockets."""

    def __init__(self, ctx: zmq.Context, engine: Engine, kv_address: str | None) -> None:
        name = next(_names)
        self.push, self.pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
        self.push.bind(f"inproc://kvx-in-{name}")
        self.pull.bind(f"inproc://kvx-out-{name}")
        links = GatewayLinks(ctx, [(f"inproc://kvx-in-{name}", f"inproc://kvx-out-{name}")])
        self.kv = KvLinks(ctx, engine, kv_address, None, watch=links.watch)
        beat = Heartbeat(ctx, [])  # never started: the loop only marks its stages
        self.thread = threading.Thread(target=_busy_loop,
                                       args=(engine, engine.ready(self.kv.address), links, None, beat, self.kv))
        self.thread.start()
        self.enc, self.dec = encoder(), worker_decoder()

    def send(self, msg) -> None:
        self.push.send(self.enc.encode(msg))

    def wait_for(self, done) -> object:
        """The first message from the loop for which `done` holds."""
        while True:
            assert self.pull.poll(30_000), "the busy loop went silent"
            msg = self.dec.decode(self.pull.recv())
            if done(msg):
                return msg

    def finish(self, request_id: str) -> list:
        """The deltas of `request_id` up to its last."""
        deltas = []
        while not deltas or deltas[-1].finish_reason is None:
            msg = self.wait_for(lambda m: isinstance(m, StepOutputs) and m.outputs)
            deltas += [delta for delta in msg.outputs if delta.request_id == request_id]
        return deltas

    def stats(self) -> Stats:
        self.send(Control(ControlCommand.STATS))
        return self.wait_for(lambda m: isinstance(m, StepOutputs) and m.stats is not None).stats

    def stop(self) -> None:
        self.send(Control(ControlCommand.SHUTDOWN))
        self.thread.join(30)
        assert not self.thread.is_alive()
        self.kv.close()
        self.push.close(linger=0)
        self.pull.close(linger=0)


@pytest.fixture()
def loops(ctx, folder, producer, consumer):
    (producer_engine, _), (consumer_engine, _) = producer, consumer
    assert producer_engine.reset_prefix_cache() and consumer_engine.reset_prefix_cache()
    gateways = Gateway(ctx, producer_engine, f"ipc://{folder}/kv-loop"), Gateway(ctx, consumer_engine, None)
    yield gateways
    for gateway in gateways:
        gateway.stop()


def test_an_idle_producer_answers_at_once_and_the_consumer_decodes_as_one_engine_alone(loops, recomputing_consumer):
    engine = recomputing_consumer[0]
    assert engine.reset_prefix_cache()
    expected = tokens(run(engine, generate(engine, "alone", PROMPT, 6)))
    producer, consumer = loops
    producer.send(generate(engine, "prefill", PROMPT, 1))
    assert [token for delta in producer.finish("prefill") for token in delta.new_token_ids] == expected[:1]
    time.sleep(0.1)  # the producer idles: its loop waits in a poll of IDLE_POLL_MS
    before = consumer.stats()
    consumer.send(generate(engine, "decode", PROMPT, 6, producer.kv.address))
    deltas = consumer.finish("decode")
    assert [token for delta in deltas for token in delta.new_token_ids] == expected
    assert deltas[0].num_cached_tokens == 64
    now = consumer.stats()
    assert now.kv_transfer_bytes_received > before.kv_transfer_bytes_received
    # From the pull's sending to its blocks taken: the producer's poll woke for it.
    assert now.kv_transfer_seconds_received - before.kv_transfer_seconds_received < IDLE_POLL_MS / 1000 / 2


def test_a_consumer_waiting_for_an_answer_waits_in_its_poll_until_the_bound(loops, folder):
    _, consumer = loops
    gone = f"ipc://{folder}/gone-loop"
    started, cpu_started = time.monotonic(), time.process_time()
    consumer.send(generate(consumer.kv.engine, "orphan", PROMPT, 4, gone))
    [delta] = consumer.finish("orphan")
    waited, cpu = time.monotonic() - started, time.process_time() - cpu_started
    assert delta.finish_reason == FinishReason.ERROR and "no answer within 1 s" in delta.error
    assert consumer.kv.engine.kv_pulls.timeout_s <= waited < 5
    assert cpu < waited / 2  # a loop spinning through the wait would take a core for all of it
