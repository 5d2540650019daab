"""A producer with a CPU tier serves the prompt blocks that other requests evicted from its GPU pool
into the tier (on the default model, CPU): the bytes it sends are those it computed, read from the
tier's host pool in prompt order beside the blocks still in its GPU pool, and a consumer fed by it
decodes the tokens one engine alone does, computing none of the blocks it pulled."""

from __future__ import annotations

import numpy as np
from kv_transfer_pair import BLOCK, generate, prefill, reference, run, tokens, usable_blocks

from spillway.protocol.kv_transfer import KvPull

PROMPT = [(13 * i + 100) % 3000 + 100 for i in range(100)]  # six usable blocks and a part
# With its 8 outputs, 8 blocks: every slot of the producer's GPU pool.
LONG_FILLER = [(7 * i) % 900 + 50 for i in range(120)]
# With its 8 outputs, 3 blocks: the pool's free slots, then the LRU's head (the prompt's deepest blocks).
SHORT_FILLER = [(5 * i) % 700 + 60 for i in range(40)]


def served(engine, transfer_id: str) -> tuple[list[bytes], np.ndarray]:
    """The producer's answer to a pull of the prompt's usable blocks: its hashes and payload."""
    hashes = generate(engine, transfer_id, PROMPT, 1).block_hashes[:usable_blocks(PROMPT)]
    answer, payload = engine.serve_kv_pull(KvPull(transfer_id=transfer_id, block_hashes=hashes))
    assert answer.error == "" and answer.block_hashes == hashes[:len(answer.block_hashes)]
    return answer.block_hashes, np.asarray(payload)


def places(engine) -> tuple[list[int], list[int]]:
    """The positions of the prompt's readable blocks read from the GPU pool and from the tier
    (once the engine has heard which stores to the tier landed, as `serve_kv_pull` does)."""
    engine.tier.stores_landed()
    prefix = engine.block_manager.readable_prefix(generate(engine, "x", PROMPT, 1).block_hashes)
    return [position for _, position in prefix.gpu_reads], [position for _, position in prefix.cpu_reads]


def prefilled_then_evicted(engine, filler: list[int]) -> np.ndarray:
    """The prompt prefilled, then `filler` run, which evicts some of its blocks to the tier; the
    payload the producer served for the prompt before the eviction, all from its GPU pool."""
    assert engine.reset_prefix_cache()
    prefill(engine, PROMPT)
    assert places(engine) == (list(range(usable_blocks(PROMPT))), [])
    hashes, before = served(engine, "before")
    assert len(hashes) == usable_blocks(PROMPT)
    stored = engine.stats().kv_offload_bytes_gpu_to_cpu
    run(engine, generate(engine, "filler", filler, 8))
    assert engine.stats().kv_offload_bytes_gpu_to_cpu > stored
    return before


def test_blocks_evicted_to_the_tier_are_served_with_the_bytes_computed(tiered_producer):
    engine, _ = tiered_producer
    before = prefilled_then_evicted(engine, LONG_FILLER)
    assert places(engine) == ([], list(range(usable_blocks(PROMPT))))  # every one on the CPU only
    hashes, after = served(engine, "after")
    assert len(hashes) == usable_blocks(PROMPT) and after.tobytes() == before.tobytes()
    engine.block_manager.check_invariants()


def test_a_prefix_half_in_the_gpu_pool_and_half_in_the_tier_is_served_in_prompt_order(tiered_producer):
    engine, _ = tiered_producer
    before = prefilled_then_evicted(engine, SHORT_FILLER)
    on_gpu, on_cpu = places(engine)
    assert on_gpu and on_cpu and sorted(on_gpu + on_cpu) == list(range(usable_blocks(PROMPT)))
    assert max(on_gpu) < min(on_cpu)  # the deepest blocks are evicted first
    hashes, after = served(engine, "mixed")
    assert len(hashes) == usable_blocks(PROMPT) and after.tobytes() == before.tobytes()


def test_a_consumer_fed_from_the_tier_decodes_as_one_engine_alone(tiered_producer, consumer, recomputing_consumer):
    (producer, producer_links), (engine, links) = tiered_producer, consumer
    expected = reference(recomputing_consumer[0], PROMPT)
    prefilled_then_evicted(producer, LONG_FILLER)
    assert places(producer)[0] == []
    assert engine.reset_prefix_cache()
    received, sent = engine.stats(), producer.stats()
    deltas = run(engine, generate(engine, "decode", PROMPT, 6, producer_links.address), links, producer_links)
    assert tokens(deltas) == expected
    assert deltas[0].num_cached_tokens == usable_blocks(PROMPT) * BLOCK  # none computed
    moved = usable_blocks(PROMPT) * engine.kv_layout.block_bytes
    now = engine.stats()
    assert now.kv_transfer_bytes_received - received.kv_transfer_bytes_received == moved
    assert now.kv_transfer_failures == received.kv_transfer_failures
    assert producer.stats().kv_transfer_bytes_sent - sent.kv_transfer_bytes_sent == moved
    producer.block_manager.check_invariants()
