from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from spillway.protocol.hashing import DEFAULT_HASH_SEED, block_hashes, root_hash
from spillway.protocol.messages import BlockHash
from spillway.worker.block_manager import BlockManager


def h(name: str) -> BlockHash:
    return BlockHash(name.encode())


def make_manager(num_gpu_blocks: int = 8, block_size: int = 4, enable_prefix_caching: bool = True) -> BlockManager:
    return BlockManager(num_gpu_blocks, block_size, enable_prefix_caching)


def ref_counts(manager: BlockManager) -> list[int]:
    return [block.ref_count for block in manager.blocks]


def test_fresh_blocks_come_in_id_order_and_only_as_many_as_needed():
    manager = make_manager()
    assert manager.allocate("a", 10)
    assert manager.block_table("a") == [0, 1, 2]
    assert manager.allocate("b", 1)
    assert manager.block_table("b") == [3]
    assert manager.allocate("a", 12)  # still fits in three blocks
    assert manager.block_table("a") == [0, 1, 2]
    assert manager.allocate("a", 13)
    assert manager.block_table("a") == [0, 1, 2, 4]
    assert manager.free_block_ids() == [5, 6, 7]
    assert manager.num_free_blocks == 3
    assert manager.usage == 5 / 8
    manager.check_invariants()


def test_release_is_tail_first_and_unhashed_blocks_go_to_the_head():
    manager = make_manager()
    manager.allocate("a", 10)  # [0, 1, 2]; block 2 is partial
    manager.commit("a", [h("a0"), h("a1")])
    manager.allocate("b", 4)  # [3]
    manager.free("a")
    # 2 can never be hit: reused first. 1 covers more tokens than 0: evicted before it.
    assert manager.free_block_ids() == [2, 4, 5, 6, 7, 1, 0]
    manager.free("b")
    assert manager.free_block_ids() == [3, 2, 4, 5, 6, 7, 1, 0]
    manager.check_invariants()


def test_freed_blocks_stay_findable_and_are_hit():
    manager = make_manager()
    manager.allocate("a", 8)
    manager.commit("a", [h("a0"), h("a1")])
    manager.free("a")
    assert manager.free_block_ids() == [2, 3, 4, 5, 6, 7, 1, 0]
    assert manager.find_cached_prefix([h("a0"), h("a1"), h("x")]) == [0, 1]
    assert manager.find_cached_prefix([h("a1")]) == [1]
    assert manager.find_cached_prefix([h("x"), h("a0")]) == []
    assert manager.allocate("b", 11, cached_blocks=[0, 1])
    assert manager.block_table("b") == [0, 1, 2]
    assert ref_counts(manager) == [1, 1, 1, 0, 0, 0, 0, 0]
    assert manager.free_block_ids() == [3, 4, 5, 6, 7]
    manager.check_invariants()


def test_allocating_the_lru_head_evicts_its_hash():
    manager = make_manager(num_gpu_blocks=4)
    manager.allocate("a", 16)
    manager.commit("a", [h("a0"), h("a1"), h("a2"), h("a3")])
    manager.free("a")
    assert manager.free_block_ids() == [3, 2, 1, 0]
    assert manager.allocate("b", 4)
    assert manager.block_table("b") == [3]
    assert manager.blocks[3].block_hash is None
    assert manager.num_cached_blocks == 3
    assert manager.find_cached_prefix([h("a3")]) == []
    assert manager.find_cached_prefix([h("a0"), h("a1"), h("a2"), h("a3")]) == [0, 1, 2]
    manager.check_invariants()


def test_two_requests_with_the_same_prefix_share_blocks():
    manager = make_manager()
    manager.allocate("a", 9)  # [0, 1, 2]
    manager.commit("a", [h("p0"), h("p1")])
    cached = manager.find_cached_prefix([h("p0"), h("p1")])
    assert manager.allocate("b", 10, cached_blocks=cached)
    assert manager.block_table("b") == [0, 1, 3]
    assert ref_counts(manager)[:4] == [2, 2, 1, 1]
    manager.free("a")
    assert ref_counts(manager)[:4] == [1, 1, 0, 1]
    assert manager.free_block_ids() == [2, 4, 5, 6, 7]
    manager.free("b")
    assert manager.free_block_ids() == [3, 2, 4, 5, 6, 7, 1, 0]
    manager.check_invariants()


def test_allocate_is_all_or_nothing():
    manager = make_manager(num_gpu_blocks=4)
    manager.allocate("a", 8)
    manager.commit("a", [h("a0"), h("a1")])
    manager.free("a")
    manager.allocate("c", 4)  # takes block 2; free: [3, 1, 0]
    # 5 blocks: the 2 free hits leave only block 3 for the 3 new ones.
    assert not manager.can_allocate("b", 20, cached_blocks=[0, 1])
    assert not manager.allocate("b", 20, cached_blocks=[0, 1])
    assert manager.block_table("b") == []
    assert manager.free_block_ids() == [3, 1, 0]
    assert ref_counts(manager) == [0, 0, 1, 0]
    assert manager.find_cached_prefix([h("a0"), h("a1")]) == [0, 1]
    assert not manager.allocate("c", 20)
    assert manager.block_table("c") == [2]
    assert manager.allocate("b", 12, cached_blocks=[0, 1])
    assert manager.block_table("b") == [0, 1, 3]
    assert manager.free_block_ids() == []
    manager.check_invariants()


def test_commit_keeps_the_existing_block_for_a_known_hash():
    manager = make_manager()
    manager.allocate("a", 4)
    manager.allocate("b", 4)
    manager.commit("a", [h("x")])
    manager.commit("b", [h("x")])
    assert manager.find_cached_prefix([h("x")]) == [0]
    assert manager.blocks[1].block_hash is None
    manager.free("b")
    assert manager.free_block_ids()[0] == 1
    manager.check_invariants()


def test_commit_registers_only_new_blocks_and_rejects_too_many_hashes():
    manager = make_manager()
    manager.allocate("a", 8)
    manager.commit("a", [h("a0")])
    manager.commit("a", [h("other"), h("a1")])  # block 0 was committed already
    assert manager.find_cached_prefix([h("a0"), h("a1")]) == [0, 1]
    assert manager.find_cached_prefix([h("other")]) == []
    with pytest.raises(ValueError):
        manager.commit("a", [h("a0"), h("a1"), h("a2")])


def test_cached_blocks_are_taken_only_at_first_allocation_and_must_still_be_cached():
    manager = make_manager(num_gpu_blocks=2)
    manager.allocate("a", 4)
    manager.commit("a", [h("a0")])
    manager.free("a")
    cached = manager.find_cached_prefix([h("a0")])
    manager.allocate("b", 4)
    with pytest.raises(ValueError):
        manager.allocate("b", 8, cached_blocks=cached)
    manager.allocate("c", 4)  # evicts block 0
    with pytest.raises(ValueError):
        manager.allocate("d", 8, cached_blocks=cached)
    manager.check_invariants()


def test_reset_prefix_cache_is_refused_while_blocks_are_in_use():
    manager = make_manager()
    manager.allocate("a", 8)
    manager.commit("a", [h("a0"), h("a1")])
    assert not manager.reset_prefix_cache()
    assert manager.find_cached_prefix([h("a0")]) == [0]
    manager.free("a")
    assert manager.reset_prefix_cache()
    assert manager.find_cached_prefix([h("a0")]) == []
    assert manager.num_cached_blocks == 0
    assert all(block.block_hash is None for block in manager.blocks)
    manager.check_invariants()


def test_with_prefix_caching_off_nothing_is_cached():
    manager = make_manager(enable_prefix_caching=False)
    manager.allocate("a", 8)
    manager.commit("a", [h("a0"), h("a1")])
    manager.free("a")
    assert manager.find_cached_prefix([h("a0")]) == []
    assert manager.num_cached_blocks == 0
    assert manager.free_block_ids() == [0, 1, 2, 3, 4, 5, 6, 7]
    manager.check_invariants()


def _bump_ref_count(manager: BlockManager) -> None:
    manager.blocks[0].ref_count += 1


def _map_hash_to_wrong_block(manager: BlockManager) -> None:
    manager._cached[h("a0")] = manager.blocks[1]


def _hash_without_entry(manager: BlockManager) -> None:
    manager.blocks[5].block_hash = h("ghost")


def _block_twice_in_a_table(manager: BlockManager) -> None:
    manager._tables["a"].block_ids.append(0)
    manager.blocks[0].ref_count += 1


def _shared_gpu_slot(manager: BlockManager) -> None:
    manager.blocks[6].gpu_slot = 0


def _free_block_dropped_from_the_list(manager: BlockManager) -> None:
    manager._free.remove(manager.blocks[7])


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (_bump_ref_count, "ref_count"),
        (_map_hash_to_wrong_block, "hash"),
        (_hash_without_entry, "does not map"),
        (_block_twice_in_a_table, "twice in its table"),
        (_shared_gpu_slot, "GPU slot"),
        (_free_block_dropped_from_the_list, "free-list membership"),
    ],
)
def test_check_invariants_catches_a_corrupted_state(corrupt, message):
    manager = make_manager()
    manager.allocate("a", 8)
    manager.commit("a", [h("a0"), h("a1")])
    manager.check_invariants()
    corrupt(manager)
    with pytest.raises(AssertionError, match=message):
        manager.check_invariants()


BLOCK_SIZE = 2
ROOT = root_hash(DEFAULT_HASH_SEED, "test-model")


class BlockManagerMachine(RuleBasedStateMachine):
    """Random requests over a tiny vocabulary (so prefixes collide) and a tiny pool.

    A simulated KV pool records the tokens written into each block; a prefix hit must
    return blocks holding exactly the request's tokens, and only unshared blocks are written.
    """

    def __init__(self) -> None:
        super().__init__()
        self.manager = BlockManager(num_gpu_blocks=10, block_size=BLOCK_SIZE)
        self.sequences: dict[str, list[int]] = {}  # live request -> its tokens
        self.num_computed: dict[str, int] = {}
        self.kv: dict[int, tuple[int, ...]] = {}
        self.next_id = 0

    @rule(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=12), first_chunk=st.integers(1, 12))
    def start(self, tokens: list[int], first_chunk: int) -> None:
        hashes = block_hashes(tokens, BLOCK_SIZE, ROOT)
        cached = self.manager.find_cached_prefix(hashes[: (len(tokens) - 1) // BLOCK_SIZE])
        for i, block_id in enumerate(cached):
            assert self.kv[block_id] == tuple(tokens[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE])
        request_id = f"r{self.next_id}"
        self.next_id += 1
        num_cached = len(cached) * BLOCK_SIZE
        free_before = self.manager.free_block_ids()
        if self.manager.allocate(request_id, min(len(tokens), num_cached + first_chunk), cached):
            self.sequences[request_id] = tokens
            self.num_computed[request_id] = num_cached
            self._compute(request_id, min(len(tokens), num_cached + first_chunk))
        else:
            assert self.manager.free_block_ids() == free_before
            assert self.manager.block_table(request_id) == []

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

    @invariant()
    def invariants_hold(self) -> None:
        self.manager.check_invariants()

    def teardown(self) -> None:
        for request_id in list(self.sequences):
            self.manager.free(request_id)
        self.manager.check_invariants()
        assert self.manager.num_free_blocks == 10

    def _compute(self, request_id: str, num_tokens: int) -> None:
        tokens, table = self.sequences[request_id], self.manager.block_table(request_id)
        assert len(table) == -(-num_tokens // BLOCK_SIZE)
        for index in range(self.num_computed[request_id] // BLOCK_SIZE, len(table)):
            assert self.manager.blocks[table[index]].ref_count == 1  # never write a shared block
            self.kv[table[index]] = tuple(tokens[index * BLOCK_SIZE : min(num_tokens, (index + 1) * BLOCK_SIZE)])
        self.num_computed[request_id] = num_tokens
        self.manager.commit(request_id, block_hashes(tokens[:num_tokens], BLOCK_SIZE, ROOT))


BlockManagerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)
TestBlockManagerProperties = BlockManagerMachine.TestCase
