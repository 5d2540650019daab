"""Disaggregated prefill and decode between two engines on the default model (CPU), over real ZeroMQ
sockets: a consumer that pulls a prompt prefilled by a producer decodes the tokens one engine alone
does, from the pulled blocks; blocks the producer no longer holds are computed; an answer that
does not fit, or none at all, applies kv_load_failure_policy; an abort while waiting leaves both
pools as they were, and the answer that comes after it is dropped."""

from __future__ import annotations

import time

import msgspec
import pytest
import torch
import zmq
from kv_transfer_pair import BLOCK, generate, prefill, reference, run, tokens, usable_blocks

from spillway.protocol.kv_transfer import KvBlocks, KvPull, kv_link_decoder
from spillway.protocol.messages import FinishReason, StructuredKind, StructuredOutput

# 40 tokens: two full blocks and a part; 48: three full blocks, whose last is computed anyway (its
# last token's logits give the first output); 100: six full blocks and a part.
PROMPTS = {length: [(13 * i + length) % 3000 + 100 for i in range(length)] for length in (40, 48, 100)}
FILLER = [(7 * i) % 900 + 50 for i in range(120)]  # with its 8 outputs, every block of the producer's pool


@pytest.mark.parametrize("length", sorted(PROMPTS))
def test_a_pulled_prompt_decodes_as_one_engine_alone_from_the_pulled_blocks(length, producer, consumer,
                                                                            recomputing_consumer):
    (producer_engine, producer_links), (engine, links) = producer, consumer
    prompt = PROMPTS[length]
    expected = reference(recomputing_consumer[0], prompt)
    assert producer_engine.reset_prefix_cache() and engine.reset_prefix_cache()
    assert prefill(producer_engine, prompt) == expected[:1]
    received, sent = engine.stats(), producer_engine.stats()
    deltas = run(engine, generate(engine, "decode", prompt, 6, producer_links.address), links, producer_links)
    assert tokens(deltas) == expected
    assert deltas[0].num_cached_tokens == usable_blocks(prompt) * BLOCK
    block_bytes = engine.kv_layout.block_bytes
    now = engine.stats()
    assert now.kv_transfer_bytes_received - received.kv_transfer_bytes_received == usable_blocks(prompt) * block_bytes
    assert now.kv_transfer_seconds_received > received.kv_transfer_seconds_received
    assert now.kv_transfer_failures == received.kv_transfer_failures
    assert producer_engine.stats().kv_transfer_bytes_sent - sent.kv_transfer_bytes_sent == usable_blocks(prompt) * block_bytes
    assert now.num_free_gpu_blocks == engine.block_manager.num_gpu_blocks  # the pulled blocks stay cached, evictable
    engine.block_manager.check_invariants()


def test_a_consumer_pulls_only_the_blocks_it_lacks_and_none_when_it_holds_them(producer, consumer):
    (producer_engine, producer_links), (engine, links) = producer, consumer
    prompt = PROMPTS[100]
    assert producer_engine.reset_prefix_cache() and engine.reset_prefix_cache()
    prefill(producer_engine, prompt)
    # The consumer holds the first two blocks already (a prompt sharing them ran there).
    run(engine, generate(engine, "shared", prompt[:2 * BLOCK + 1], 1))
    before = engine.stats().kv_transfer_bytes_received
    first = run(engine, generate(engine, "first", prompt, 2, producer_links.address), links, producer_links)
    assert engine.stats().kv_transfer_bytes_received - before == (usable_blocks(prompt) - 2) * engine.kv_layout.block_bytes
    assert first[0].num_cached_tokens == usable_blocks(prompt) * BLOCK
    # Now it holds every one: the request runs at once, without a pull.
    before_sent = producer_engine.stats().kv_transfer_bytes_sent
    again = run(engine, generate(engine, "again", prompt, 2, producer_links.address), links, producer_links)
    assert tokens(again) == tokens(first) and again[0].num_cached_tokens == usable_blocks(prompt) * BLOCK
    assert producer_engine.stats().kv_transfer_bytes_sent == before_sent


def test_a_constrained_request_compiles_its_grammar_once_its_blocks_are_pulled(producer, consumer,
                                                                                recomputing_consumer):
    (producer_engine, producer_links), (engine, links) = producer, consumer
    prompt = PROMPTS[100]
    choice = StructuredOutput(kind=StructuredKind.CHOICE, spec='["yes", "no", "maybe"]')

    def constrained(target, request_id, source=None):
        msg = generate(target, request_id, prompt, 8, source)
        return msgspec.structs.replace(msg, params=msgspec.structs.replace(msg.params, ignore_eos=False,
                                                                           structured=choice))

    alone = recomputing_consumer[0]
    assert alone.reset_prefix_cache()
    expected = tokens(run(alone, constrained(alone, "alone")))
    assert producer_engine.reset_prefix_cache() and engine.reset_prefix_cache()
    prefill(producer_engine, prompt)
    deltas = run(engine, constrained(engine, "decode", producer_links.address), links, producer_links)
    assert tokens(deltas) == expected and deltas[-1].finish_reason == FinishReason.STOP
    assert deltas[0].num_cached_tokens == usable_blocks(prompt) * BLOCK


def test_a_constrained_requests_grammar_compiles_while_its_blocks_travel(producer, consumer, monkeypatch):
    """The compile begins when the request is held for its pull, not when the blocks have come,
    and it is not begun again on its release."""
    (producer_engine, producer_links), (engine, links) = producer, consumer
    prompt = PROMPTS[40]
    assert producer_engine.reset_prefix_cache() and engine.reset_prefix_cache()
    prefill(producer_engine, prompt)
    submitted = []
    submit = engine.constrained.compiler.submit
    monkeypatch.setattr(engine.constrained.compiler, "submit", lambda spec: submitted.append(spec) or submit(spec))
    msg = generate(engine, "overlap", prompt, 8, producer_links.address)
    choice = StructuredOutput(kind=StructuredKind.CHOICE, spec='["left", "right"]')
    msg = msgspec.structs.replace(msg, params=msgspec.structs.replace(msg.params, ignore_eos=False, structured=choice))
    assert engine.add_request(msg) is None
    assert "overlap" in engine.kv_pulls and submitted == [choice]  # held for its blocks, compiling already
    deltas = []
    while engine.has_work:  # as kv_transfer_pair.run drives it, the request already in
        links.send_pulls()
        producer_links.handle(20)
        links.handle(20 if engine.waits_for_pulls else 0)
        deltas += links.take_deltas() + engine.step()
    assert submitted == [choice]  # not compiled again when its blocks came
    assert deltas[-1].request_id == "overlap" and deltas[-1].finish_reason == FinishReason.STOP
    assert deltas[0].num_cached_tokens == usable_blocks(prompt) * BLOCK


def test_blocks_the_producer_evicted_are_computed(producer, consumer, recomputing_consumer):
    (producer_engine, producer_links), (engine, links) = producer, consumer
    prompt = PROMPTS[100]
    expected = reference(recomputing_consumer[0], prompt)
    assert producer_engine.reset_prefix_cache() and engine.reset_prefix_cache()
    prefill(producer_engine, prompt)
    run(producer_engine, generate(producer_engine, "filler", FILLER, 8))  # takes every slot of its pool
    prompt_hashes = generate(producer_engine, "x", prompt, 1).block_hashes
    assert producer_engine.block_manager.readable_prefix(prompt_hashes).num_blocks == 0
    before = engine.stats()
    deltas = run(engine, generate(engine, "decode", prompt, 6, producer_links.address), links, producer_links)
    assert tokens(deltas) == expected and deltas[0].num_cached_tokens == 0
    now = engine.stats()
    assert now.kv_transfer_bytes_received == before.kv_transfer_bytes_received
    assert now.kv_transfer_failures == before.kv_transfer_failures  # an empty answer is no failure


def test_blocks_evicted_for_pulled_ones_reach_the_cpu_tier_before_their_slots_are_overwritten(
        producer, consumer, recomputing_consumer):
    (producer_engine, producer_links), (engine, links) = producer, recomputing_consumer
    prompts = {"first": PROMPTS[100], "second": [(17 * i) % 2500 + 200 for i in range(100)],
               "pulled": [(11 * i) % 2000 + 300 for i in range(120)]}
    expected = reference(consumer[0], prompts["pulled"])
    assert producer_engine.reset_prefix_cache() and engine.reset_prefix_cache()
    prefill(producer_engine, prompts["pulled"])
    for name in ("first", "second"):
        run(engine, generate(engine, name, prompts[name], 6))
    manager, pool = engine.block_manager, engine.runner.kv_cache
    # What the cached blocks without a CPU copy hold: an eviction writes that back.
    uncopied = {block.block_id: pool[block.gpu_slot].clone() for block in manager.blocks
                if block.block_hash is not None and block.gpu_slot is not None and block.cpu_slot is None}
    assert engine.add_request(generate(engine, "pulled", prompts["pulled"], 6, producer_links.address)) is None
    stored = engine.stats().kv_offload_bytes_gpu_to_cpu
    links.send_pulls()
    assert producer_links.handle(5000) and links.handle(5000) and links.take_deltas() == []
    written_back = [block for block in manager.blocks if block.block_id in uncopied and block.cpu_slot is not None]
    assert written_back and engine.stats().kv_offload_bytes_gpu_to_cpu > stored
    cpu_pool = engine.executor.kv_copier.cpu_pool
    for block in written_back:  # the block's own KV, not the pulled block's now in its old slot
        assert torch.equal(cpu_pool[block.cpu_slot], uncopied[block.block_id])
    deltas = []
    while engine.has_work:
        deltas += engine.step()
    assert tokens(deltas) == expected and deltas[0].num_cached_tokens == usable_blocks(prompts["pulled"]) * BLOCK
    manager.check_invariants()


class FakeProducer:
    """A ROUTER that takes a pull and answers what the test says."""

    def __init__(self, ctx: zmq.Context, address: str) -> None:
        self.address = address
        self.socket = ctx.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(address)

    def take_pull(self) -> tuple[bytes, KvPull]:
        assert self.socket.poll(5000), "no pull came"
        identity, body = self.socket.recv_multipart()
        return identity, kv_link_decoder().decode(body)

    def answer(self, identity: bytes, answer: KvBlocks, payload: bytes) -> None:
        self.socket.send_multipart([identity, msgspec.msgpack.encode(answer), payload])

    def close(self) -> None:
        self.socket.close(linger=0)


def bad_answer(kind: str, engine, pull: KvPull) -> tuple[KvBlocks, bytes, str]:
    """An answer to `pull` that does not fit `engine`, and what its error says."""
    layout, count = engine.kv_layout, len(pull.block_hashes)
    good = dict(transfer_id=pull.transfer_id, block_hashes=pull.block_hashes, model=engine.model_name,
                dtype=layout.dtype, block_shape=list(layout.block_shape))
    payload = bytes(count * layout.block_bytes)
    if kind == "model":
        return KvBlocks(**good | {"model": "another-model"}), payload, "of model 'another-model'"
    if kind == "layout":
        return (KvBlocks(**good | {"dtype": "bfloat16"}), bytes(count * layout.block_bytes // 2),
                f"bfloat16 {list(layout.block_shape)}; this worker's are float32")
    if kind == "bytes":
        return KvBlocks(**good), payload[:-1], f"{len(payload) - 1} bytes for {count} blocks"
    if kind == "hashes":
        return KvBlocks(**good | {"block_hashes": [bytes(16)]}), bytes(layout.block_bytes), "not a prefix"
    assert kind == "refused"
    return KvBlocks(**good | {"block_hashes": [], "error": "a pull of 3 frames"}), b"", "refused the pull"


@pytest.mark.parametrize("kind", ["model", "layout", "bytes", "hashes", "refused"])
def test_an_answer_that_does_not_fit_fails_the_request_naming_the_producer(kind, ctx, folder, consumer):
    engine, links = consumer
    fake = FakeProducer(ctx, f"ipc://{folder}/fake-{kind}")
    try:
        assert engine.reset_prefix_cache()
        before = engine.stats()
        assert engine.add_request(generate(engine, "bad", PROMPTS[40], 4, fake.address)) is None
        assert engine.has_work and engine.waits_for_pulls
        links.send_pulls()
        identity, pull = fake.take_pull()
        assert pull.block_hashes == generate(engine, "bad", PROMPTS[40], 4).block_hashes[:2]
        answer, payload, reason = bad_answer(kind, engine, pull)
        fake.answer(identity, answer, payload)
        assert links.handle(5000)
        [delta] = links.take_deltas()
        assert delta.request_id == "bad" and delta.finish_reason == FinishReason.ERROR
        assert delta.error.startswith(f"the KV transfer from {fake.address} failed: ") and reason in delta.error
        assert not engine.has_work
        now = engine.stats()
        assert now.kv_transfer_failures == before.kv_transfer_failures + 1
        assert now.kv_transfer_bytes_received == before.kv_transfer_bytes_received
        assert engine.block_manager.num_cached_blocks == 0  # nothing of it was taken
        engine.block_manager.check_invariants()
    finally:
        fake.close()


def test_with_recompute_an_answer_that_does_not_fit_leaves_the_prompt_computed(ctx, folder, recomputing_consumer):
    engine, links = recomputing_consumer
    expected = reference(engine, PROMPTS[40])
    fake = FakeProducer(ctx, f"ipc://{folder}/fake-recompute")
    try:
        before = engine.stats().kv_transfer_failures
        assert engine.add_request(generate(engine, "bad", PROMPTS[40], 6, fake.address)) is None
        links.send_pulls()
        identity, pull = fake.take_pull()
        answer, payload, _ = bad_answer("layout", engine, pull)
        fake.answer(identity, answer, payload)
        assert links.handle(5000) and links.take_deltas() == []
        deltas = []
        while engine.has_work:
            deltas += engine.step()
        assert tokens(deltas) == expected and deltas[0].num_cached_tokens == 0
        assert engine.stats().kv_transfer_failures == before + 1
    finally:
        fake.close()


def assert_policy_applied(policy: str, deltas, error: str, expected: list[int]) -> None:
    """A failed pull's request: ended with `error` ("fail"), or its prompt computed to the
    `expected` tokens from no cached block ("recompute")."""
    if policy == "fail":
        [delta] = deltas
        assert delta.finish_reason == FinishReason.ERROR and delta.error == error
    else:
        assert tokens(deltas) == expected and deltas[0].num_cached_tokens == 0


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_a_producer_that_never_answers_applies_the_policy_after_the_bound(policy, folder, consumer,
                                                                          recomputing_consumer):
    engine, links = consumer if policy == "fail" else recomputing_consumer
    expected = reference(recomputing_consumer[0], PROMPTS[40])
    gone = f"ipc://{folder}/gone"
    before = engine.stats().kv_transfer_failures
    started = time.monotonic()
    deltas = run(engine, generate(engine, "orphan", PROMPTS[40], 6, gone), links, bound_s=20)
    waited = time.monotonic() - started
    assert engine.kv_pulls.timeout_s <= waited < 10
    assert engine.stats().kv_transfer_failures == before + 1
    assert_policy_applied(policy, deltas, f"the KV transfer from {gone} failed: no answer within 1 s", expected)


def test_an_abort_while_waiting_leaves_both_pools_as_they_were_and_the_late_answer_is_dropped(producer, consumer):
    (producer_engine, producer_links), (engine, links) = producer, consumer
    prompt = PROMPTS[100]
    assert producer_engine.reset_prefix_cache() and engine.reset_prefix_cache()
    prefill(producer_engine, prompt)
    producer_free, free = producer_engine.block_manager.num_free_blocks, engine.block_manager.free_gpu_slots()
    before, sent = engine.stats(), producer_engine.stats().kv_transfer_bytes_sent
    assert engine.add_request(generate(engine, "gone", prompt, 6, producer_links.address)) is None
    links.send_pulls()
    [delta] = engine.abort(["gone"])
    assert delta.finish_reason == FinishReason.ABORT and not engine.has_work
    assert producer_links.handle(5000)  # the producer answers the pull, with its blocks
    assert producer_engine.stats().kv_transfer_bytes_sent - sent == usable_blocks(prompt) * engine.kv_layout.block_bytes
    assert links.handle(5000) and links.take_deltas() == []  # the answer came, and was dropped
    assert engine.block_manager.free_gpu_slots() == free and engine.block_manager.num_cached_blocks == 0
    assert producer_engine.block_manager.num_free_blocks == producer_free
    now = engine.stats()
    assert (now.kv_transfer_bytes_received, now.kv_transfer_failures) == (before.kv_transfer_bytes_received,
                                                                          before.kv_transfer_failures)
    engine.block_manager.check_invariants()


def test_a_pull_that_does_not_decode_is_answered_with_an_error(ctx, producer):
    _, producer_links = producer
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(producer_links.address)
    try:
        dealer.send(b"\xc1 not msgpack")
        assert producer_links.handle(5000)
        assert dealer.poll(5000)
        header, payload = dealer.recv_multipart()
        answer = kv_link_decoder().decode(header)
        assert isinstance(answer, KvBlocks) and answer.block_hashes == [] and payload == b""
        assert "does not decode" in answer.error
    finally:
        dealer.close(linger=0)


def test_a_request_naming_a_source_is_refused_by_a_worker_that_does_not_consume(producer):
    engine, links = producer
    error = engine.add_request(generate(engine, "misrouted", PROMPTS[40], 4, links.address))
    assert error.finish_reason == FinishReason.ERROR
    assert error.error == f"the request names a KV source ({links.address}), and this worker is no KV consumer " \
                          "(its kv_role: kv_producer)"
    assert not engine.has_work


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_a_producer_the_gateway_lost_applies_the_policy_at_once(policy, folder, consumer, recomputing_consumer):
    """KvSourceLost: the pulls waiting on that producer fail when the gateway says so, long before
    their answer would be overdue; pulls from other producers wait on."""
    engine, links = consumer if policy == "fail" else recomputing_consumer
    expected = reference(recomputing_consumer[0], PROMPTS[40])
    lost, other = f"ipc://{folder}/lost-{policy}", f"ipc://{folder}/other-{policy}"
    engine.kv_pulls.timeout_s = 600.0  # the bound cannot be what ends them
    try:
        assert engine.add_request(generate(engine, "on-lost", PROMPTS[40], 6, lost)) is None
        assert engine.add_request(generate(engine, "on-other", PROMPTS[48], 6, other)) is None
        links.send_pulls()
        deltas = engine.kv_source_lost(lost)
        assert engine.kv_pulls.request_ids() == ["on-other"]
        started = time.monotonic()
        while not any(d.request_id == "on-lost" and d.finish_reason is not None for d in deltas):
            deltas += engine.step()  # recompute: the prompt runs; fail: it has ended already
            assert time.monotonic() - started < 60
        assert engine.kv_pulls.request_ids() == ["on-other"]
    finally:
        engine.abort(["on-other"])
        engine.kv_pulls.timeout_s = 1.0
    assert_policy_applied(policy, [d for d in deltas if d.request_id == "on-lost"],
                          f"the KV transfer from {lost} failed: the gateway lost that prefill worker", expected)
