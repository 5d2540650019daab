"""KV events from the engine on the default model (CPU): the hashes reported are the gateway's own
block hashes of each request's tokens, a consumer replaying the reports taken after every step
holds exactly what the cache can find, through evictions, a CPU tier, an abort and a reset; and
an engine without `kv_events` reports nothing."""

from __future__ import annotations

import pytest
from kv_events_consumer import KvEventsConsumer

from spillway.protocol.config import WorkerConfig
from spillway.protocol.hashing import block_hashes
from spillway.protocol.local import model_files
from spillway.protocol.messages import BlockHash, Generate, KvEvents, SamplingParams
from spillway.worker.driver.engine import Engine

BLOCK = 16
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
PROMPT_A = [(7 * i) % 500 + 10 for i in range(40)]  # two full blocks (its 4 outputs complete none)
PROMPT_B = PROMPT_A[:32] + [(11 * i) % 500 + 10 for i in range(14)]  # a's two blocks; its outputs complete a third
FILLERS = [[(5 * i + k) % 500 + 20 for i in range(60)] for k in range(2)]  # three full blocks each


def engine_for(kv_events: bool, num_cpu_blocks: int = 0) -> Engine:
    """A pool of 6 blocks of 16 tokens: a 64-token request takes 4 of them."""
    engine = Engine(WorkerConfig(model=str(model_files.resolve_model(None).path), device="cpu", dtype="float32",
                                 max_num_seqs=4, max_model_len=64, num_gpu_blocks_override=6,
                                 num_cpu_blocks_override=num_cpu_blocks, kv_events=kv_events))
    engine.debug_invariants = True  # and the engine's own replay checked at every take
    return engine


@pytest.fixture(scope="module")
def engine():
    engine = engine_for(kv_events=True, num_cpu_blocks=4)
    yield engine
    engine.close()


def hashes(engine: Engine, tokens: list[int]) -> list[BlockHash]:
    """The gateway's hashes of the full blocks of `tokens` (gateway/text/tokenizer.py's PromptHasher)."""
    return block_hashes(tokens, BLOCK, engine.root_hash)


def run(engine: Engine, consumer: KvEventsConsumer, request_id: str, prompt: list[int],
        gateway_hashes: bool = True) -> tuple[list[int], list[KvEvents]]:
    """The request run to its end, a report taken after every step; its tokens and the reports.
    Without `gateway_hashes` the worker hashes the prompt's blocks itself."""
    assert engine.add_request(Generate(request_id=request_id, prompt_token_ids=prompt,
                                       block_hashes=hashes(engine, prompt) if gateway_hashes else [],
                                       params=GREEDY)) is None
    tokens, reports = [], []
    while engine.has_work:
        tokens += [token for delta in engine.step() for token in delta.new_token_ids]
        if (events := engine.take_kv_events()) is not None:
            reports.append(events)
        consumer.apply(events)
        assert consumer.held == engine.block_manager.held_block_hashes()
    return tokens, reports


def stored(reports: list[KvEvents]) -> list[bytes]:
    return [block_hash for events in reports for block_hash in events.stored]


def test_the_reported_hashes_are_the_gateways_and_replay_exactly(engine):
    assert engine.reset_prefix_cache()
    consumer = KvEventsConsumer()
    consumer.apply(engine.take_kv_events())
    assert consumer.num_cleared == 1 and consumer.held == set()
    _, reports = run(engine, consumer, "a", PROMPT_A)
    assert stored(reports) == hashes(engine, PROMPT_A)[:2] and consumer.num_removed == 0
    b_tokens, reports = run(engine, consumer, "b", PROMPT_B, gateway_hashes=False)
    # The worker's own hash of the block b's outputs completed is the gateway's.
    assert stored(reports) == hashes(engine, PROMPT_B + b_tokens)[2:3]
    # The filler evicts cached blocks from the GPU: written back to the CPU tier, still held.
    _, reports = run(engine, consumer, "filler-0", FILLERS[0])
    assert stored(reports) == hashes(engine, FILLERS[0])[:3] and consumer.num_removed == 0
    on_cpu_only = [block.block_hash for block in engine.block_manager.blocks
                   if block.block_hash is not None and block.gpu_slot is None]
    assert on_cpu_only and set(on_cpu_only) <= consumer.held
    # b's next turn: its history found on both tiers, the block on the CPU loaded back (no
    # event), its hashes still held.
    _, reports = run(engine, consumer, "b-again", PROMPT_B + b_tokens)
    assert engine.scheduler.counts.cached_tokens_cpu == 16 and stored(reports) == []
    assert set(hashes(engine, PROMPT_B + b_tokens)[:3]) <= consumer.held
    # The second filler overflows the tier: blocks on the CPU only lose their copies, and are gone.
    _, reports = run(engine, consumer, "filler-1", FILLERS[1])
    assert stored(reports) == hashes(engine, FILLERS[1])[:3] and consumer.num_removed > 0
    engine.block_manager.check_invariants()


def test_an_abort_and_a_reset_replay_exactly(engine):
    consumer = KvEventsConsumer()
    assert engine.reset_prefix_cache()
    consumer.apply(engine.take_kv_events())
    assert engine.add_request(Generate(request_id="long", prompt_token_ids=FILLERS[0],
                                       block_hashes=hashes(engine, FILLERS[0]), params=GREEDY)) is None
    engine.step()  # the prompt in one chunk: three full blocks
    consumer.apply(engine.take_kv_events())
    assert consumer.held == set(hashes(engine, FILLERS[0])[:3])
    assert [delta.request_id for delta in engine.abort(["long"])] == ["long"]
    assert engine.take_kv_events() is None  # its blocks stay cached
    assert engine.reset_prefix_cache()
    assert engine.take_kv_events() == KvEvents(stored=[], removed=[], cleared=True)


def test_the_engines_debug_check_catches_a_report_that_disagrees_with_the_cache(engine):
    engine.take_kv_events()
    engine.block_manager._events.stored(BlockHash(b"never-held".ljust(16, b".")))
    with pytest.raises(AssertionError, match="KV events disagree with the prefix cache: 0 held hashes never"
                                             " reported, 1 reported hashes no longer held"):
        engine.take_kv_events()
    engine._kv_replay.held = engine.block_manager.held_block_hashes()  # the engine's view, repaired for what follows


def test_an_engine_without_kv_events_reports_nothing():
    engine = engine_for(kv_events=False)
    try:
        for request_id, prompt in (("a", PROMPT_A), ("filler-0", FILLERS[0]), ("filler-1", FILLERS[1])):
            assert engine.add_request(Generate(request_id=request_id, prompt_token_ids=prompt,
                                               block_hashes=hashes(engine, prompt), params=GREEDY)) is None
            while engine.has_work:
                engine.step()
                assert engine.take_kv_events() is None
        assert engine.block_manager.held_block_hashes()  # it holds blocks all the same
        assert engine.kv_events_snapshot() is None
        assert engine.reset_prefix_cache() and engine.take_kv_events() is None
    finally:
        engine.close()
