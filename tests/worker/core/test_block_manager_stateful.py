"""The block manager under random requests, growth, releases and resets (hypothesis state
machine): prefix hits hold exactly the request's tokens, no shared block is written, and the KV
events reported now and then replay to exactly the hashes held."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from kv_events_consumer import KvEventsConsumer

from spillway.protocol.hashing import DEFAULT_HASH_SEED, block_hashes, root_hash
from spillway.worker.core.block_manager import BlockManager

BLOCK_SIZE = 2
ROOT = root_hash(DEFAULT_HASH_SEED, "test-model")


class BlockManagerMachine(RuleBasedStateMachine):
    """Random requests over a tiny vocabulary (so prefixes collide) and a tiny pool.

    A simulated KV pool records the tokens written into each GPU slot; a prefix hit must
    return blocks whose slots hold exactly the request's tokens, and only unshared blocks are
    written. `reset` makes block ids and slots part ways, so a mix-up of the two shows.
    """

    def __init__(self) -> None:
        super().__init__()
        self.manager = BlockManager(num_gpu_blocks=10, block_size=BLOCK_SIZE, kv_events=True)
        self.consumer = KvEventsConsumer()
        self.sequences: dict[str, list[int]] = {}  # live request -> its tokens
        self.num_computed: dict[str, int] = {}
        self.kv: dict[int, tuple[int, ...]] = {}
        self.next_id = 0

    @rule(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=12), first_chunk=st.integers(1, 12))
    def start(self, tokens: list[int], first_chunk: int) -> None:
        hashes = block_hashes(tokens, BLOCK_SIZE, ROOT)
        cached = self.manager.find_cached_prefix(hashes[: (len(tokens) - 1) // BLOCK_SIZE])
        for i, block_id in enumerate(cached):
            slot = self.manager.blocks[block_id].gpu_slot
            assert self.kv[slot] == tuple(tokens[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE])
        request_id = f"r{self.next_id}"
        self.next_id += 1
        num_cached = len(cached) * BLOCK_SIZE
        free_before = self.manager.free_gpu_slots()
        if self.manager.allocate(request_id, min(len(tokens), num_cached + first_chunk), cached):
            self.sequences[request_id] = tokens
            self.num_computed[request_id] = num_cached
            self._compute(request_id, min(len(tokens), num_cached + first_chunk))
        else:
            assert self.manager.free_gpu_slots() == free_before
            assert self.manager.slot_table(request_id) == []

    @precondition(lambda self: self.sequences)
    @rule(data=st.data(), num_tokens=st.integers(1, 6))
    def grow(self, data: st.DataObject, num_tokens: int) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.sequences)))
        target = min(len(self.sequences[request_id]), self.num_computed[request_id] + num_tokens)
        if self.manager.allocate(request_id, target):
            self._compute(request_id, target)

    @precondition(lambda self: self.sequences)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.sequences)))
        self.manager.free(request_id)
        del self.sequences[request_id], self.num_computed[request_id]

    @rule()
    def reset(self) -> None:
        assert self.manager.reset_prefix_cache() == (not self.sequences)

    @rule()
    def report(self) -> None:
        self.consumer.take_from(self.manager)

    @invariant()
    def invariants_hold(self) -> None:
        self.manager.check_invariants()

    def teardown(self) -> None:
        for request_id in list(self.sequences):
            self.manager.free(request_id)
        self.manager.check_invariants()
        assert self.manager.num_free_blocks == 10
        self.consumer.take_from(self.manager)

    def _compute(self, request_id: str, num_tokens: int) -> None:
        tokens, table = self.sequences[request_id], self.manager.slot_table(request_id)
        block_ids = self.manager.block_ids(request_id)
        assert len(table) == len(block_ids) == -(-num_tokens // BLOCK_SIZE)
        for index in range(self.num_computed[request_id] // BLOCK_SIZE, len(table)):
            assert self.manager.blocks[block_ids[index]].ref_count == 1  # never write a shared block
            self.kv[table[index]] = tuple(tokens[index * BLOCK_SIZE : min(num_tokens, (index + 1) * BLOCK_SIZE)])
        self.num_computed[request_id] = num_tokens
        self.manager.commit(request_id, block_hashes(tokens[:num_tokens], BLOCK_SIZE, ROOT))


BlockManagerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)
TestBlockManagerProperties = BlockManagerMachine.TestCase
