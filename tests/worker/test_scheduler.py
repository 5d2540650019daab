from __future__ import annotations

import random

import pytest

from spillway.protocol.hashing import DEFAULT_HASH_SEED, block_hashes, root_hash
from spillway.protocol.messages import FinishReason, Generate, SamplingParams
from spillway.worker.block_manager import BlockManager
from spillway.worker.request import Request, RequestStatus
from spillway.worker.scheduler import Scheduler, StepPlan, StepResult

ROOT = root_hash(DEFAULT_HASH_SEED, "test-model")
NO_EOS = 999  # never produced by the fake model


def fake_token(request: Request) -> int:
    return len(request.all_token_ids) % 7 + 100


def expected_outputs(num_prompt_tokens: int, num_outputs: int) -> list[int]:
    return [(num_prompt_tokens + i) % 7 + 100 for i in range(num_outputs)]


class Harness:
    """A scheduler over a fresh block manager, driven by a fake model.

    The fake model writes each chunk's tokens into a simulated KV pool through the chunk's
    block table and checks that every earlier position of the request reads back its own
    token, so a wrong prefix hit or a block shared by mistake fails the step.
    """

    def __init__(self, *, block_size=4, num_blocks=64, max_num_seqs=8, max_num_batched_tokens=64,
                 max_model_len=64, enable_prefix_caching=True, eos_token_ids=(NO_EOS,)):
        self.block_size = block_size
        self.manager = BlockManager(num_blocks, block_size, enable_prefix_caching)
        self.scheduler = Scheduler(
            self.manager, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len, block_size=block_size, root_hash=ROOT,
            eos_token_ids=list(eos_token_ids),
        )
        self.kv: dict[tuple[int, int], int] = {}
        self.num_added = 0
        self.results: dict[str, list[StepResult]] = {}

    def request(self, request_id: str, prompt: list[int], *, priority=0, hashed=True, **params) -> Request:
        hashes = block_hashes(prompt, self.block_size, ROOT) if hashed else []
        msg = Generate(request_id=request_id, prompt_token_ids=prompt, block_hashes=hashes,
                       params=SamplingParams(**{"max_tokens": 16, **params}), priority=priority)
        self.num_added += 1
        return Request.from_generate(msg, arrival_index=self.num_added)

    def add(self, request_id: str, prompt: list[int], **kwargs) -> Request:
        request = self.request(request_id, prompt, **kwargs)
        self.scheduler.add(request)
        return request

    def step(self) -> tuple[StepPlan, list[StepResult]]:
        plan = self.scheduler.schedule()
        sampled = {}
        for chunk in plan.chunks:
            tokens, end = chunk.request.all_token_ids, chunk.start + chunk.num_tokens
            assert chunk.start == chunk.request.num_computed_tokens
            assert len(chunk.slot_table) == -(-end // self.block_size)
            for pos in range(chunk.start):
                assert self.kv[self._slot(chunk.slot_table, pos)] == tokens[pos], (chunk, pos)
            for pos in range(chunk.start, end):
                self.kv[self._slot(chunk.slot_table, pos)] = tokens[pos]
            if chunk.sample:
                sampled[chunk.request.request_id] = fake_token(chunk.request)
        assert plan.num_batched_tokens == sum(chunk.num_tokens for chunk in plan.chunks)
        assert plan.num_batched_tokens <= self.scheduler.max_num_batched_tokens
        assert len(plan.chunks) <= self.scheduler.max_num_seqs
        results = self.scheduler.update(plan, sampled)
        self.manager.check_invariants()
        for result in results:
            self.results.setdefault(result.request.request_id, []).append(result)
        return plan, results

    def run(self, max_steps: int = 500) -> None:
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished:
                return
            self.step()
        raise AssertionError("requests did not finish")

    def _slot(self, slot_table: list[int], pos: int) -> tuple[int, int]:
        return slot_table[pos // self.block_size], pos % self.block_size


def chunks(plan: StepPlan) -> list[tuple]:
    return [(c.request.request_id, c.start, c.num_tokens, c.slot_table, c.sample) for c in plan.chunks]


def test_chunked_prefill_splits_exactly_under_the_budget():
    harness = Harness(max_num_batched_tokens=8)
    harness.add("a", list(range(20)))
    plan, results = harness.step()
    assert chunks(plan) == [("a", 0, 8, [0, 1], False)] and results == []
    assert chunks(harness.step()[0]) == [("a", 8, 8, [0, 1, 2, 3], False)]
    plan, results = harness.step()
    assert chunks(plan) == [("a", 16, 4, [0, 1, 2, 3, 4], True)]
    assert [r.new_token_ids for r in results] == [[106]]
    assert chunks(harness.step()[0]) == [("a", 20, 1, [0, 1, 2, 3, 4, 5], True)]


def test_a_waiting_request_gets_a_partial_chunk_with_the_leftover_budget():
    harness = Harness(max_num_batched_tokens=8)
    harness.add("a", list(range(6)))
    harness.add("b", list(range(10)))
    assert chunks(harness.step()[0]) == [("a", 0, 6, [0, 1], True), ("b", 0, 2, [2], False)]
    assert chunks(harness.step()[0]) == [("a", 6, 1, [0, 1], True), ("b", 2, 7, [2, 3, 4], False)]
    assert chunks(harness.step()[0]) == [("a", 7, 1, [0, 1], True), ("b", 9, 1, [2, 3, 4], True)]


def test_max_num_seqs_caps_the_running_requests():
    harness = Harness(max_num_seqs=2)
    for request_id in "abc":
        harness.add(request_id, [1, 2, 3, 4], max_tokens=2)
    assert [c[0] for c in chunks(harness.step()[0])] == ["a", "b"]
    assert harness.scheduler.num_running == 2 and harness.scheduler.num_waiting == 1
    plan, results = harness.step()
    assert [c[0] for c in chunks(plan)] == ["a", "b"]
    assert [r.finish_reason for r in results] == [FinishReason.LENGTH, FinishReason.LENGTH]
    # b's block 1 duplicated a's cached block 0, so it stayed unhashed and is reused first.
    assert chunks(harness.step()[0]) == [("c", 0, 4, [1], True)]


def test_running_decodes_are_scheduled_before_a_new_prefill():
    harness = Harness(max_num_batched_tokens=16)
    harness.add("a", [1, 2, 3, 4])
    harness.step()
    harness.add("b", list(range(30)))
    assert chunks(harness.step()[0]) == [("a", 4, 1, [0, 1], True), ("b", 0, 15, [2, 3, 4, 5], False)]


def test_priority_orders_the_waiting_queue_then_arrival():
    harness = Harness(max_num_seqs=1)
    harness.add("low", [1, 2], priority=1, max_tokens=1)
    harness.add("high", [3, 4], priority=0, max_tokens=1)
    harness.add("high2", [5, 6], priority=0, max_tokens=1)
    order = [chunks(harness.step()[0])[0][0] for _ in range(3)]
    assert order == ["high", "high2", "low"]


@pytest.mark.parametrize("num_prompt_tokens, num_cached", [(32, 16), (33, 32), (31, 16), (16, 0)])
def test_a_prefix_hit_always_recomputes_the_last_prompt_token(num_prompt_tokens, num_cached):
    harness = Harness(block_size=16, num_blocks=16, max_model_len=128)
    prompt = list(range(num_prompt_tokens))
    harness.add("a", prompt, max_tokens=1)
    harness.run()
    harness.add("b", prompt, max_tokens=2)
    plan, results = harness.step()
    ((_, start, num_tokens, slot_table, sample),) = chunks(plan)
    assert (start, num_tokens, sample) == (num_cached, num_prompt_tokens - num_cached, True)
    assert results[0].num_cached_tokens == num_cached
    assert harness.results["a"][0].num_cached_tokens == 0
    assert harness.scheduler.prefix_cache_queries == 2 * num_prompt_tokens
    assert harness.scheduler.prefix_cache_hits == num_cached
    assert harness.step()[1][0].num_cached_tokens == -1  # only the first output carries it


def test_a_shared_system_prompt_hits_across_different_questions():
    harness = Harness()
    system = [7, 7, 7, 7, 8, 8, 8, 8, 9]  # two full blocks and one token
    harness.add("a", system + [50, 51])
    plan_a, _ = harness.step()
    harness.add("b", system + [60, 61, 62, 63, 64])
    harness.add("c", [1] + system)
    plan_b, results = harness.step()
    table_a = plan_a.chunks[0].slot_table
    assert chunks(plan_b) == [("a", 11, 1, table_a, True), ("b", 8, 6, table_a[:2] + [3, 4], True),
                              ("c", 0, 10, [5, 6, 7], True)]
    assert [r.num_cached_tokens for r in results[1:]] == [8, 0]
    blocks_a = [harness.manager.blocks[i] for i in harness.manager.block_ids("a")]
    assert [block.gpu_slot for block in blocks_a] == table_a
    assert [block.ref_count for block in blocks_a] == [2, 2, 1]
    assert harness.scheduler.prefix_cache_hits == 8


@pytest.mark.parametrize("hashed_by_gateway", [True, False])
def test_blocks_completed_by_generated_tokens_are_committed_and_hit(hashed_by_gateway):
    harness = Harness()
    harness.add("a", list(range(6)), max_tokens=6, hashed=hashed_by_gateway)
    harness.run()
    # 12 tokens, 11 computed: blocks 0 and 1 (tokens 6 and 7 generated) are cached.
    a_tokens = harness.results["a"][-1].request.all_token_ids
    harness.add("b", a_tokens, max_tokens=1)
    plan, results = harness.step()
    assert chunks(plan) == [("b", 8, 4, [0, 1, 2], True)]  # a's partial block 2 is reused first
    assert results[0].num_cached_tokens == 8


def test_running_out_of_blocks_preempts_the_newest_which_resumes_and_completes():
    harness = Harness(num_blocks=8, max_model_len=32)
    harness.add("a", list(range(8)), max_tokens=12)
    b = harness.add("b", list(range(10, 18)), max_tokens=12)
    for _ in range(9):
        harness.step()
        assert harness.scheduler.num_preemptions == 0
    plan, _ = harness.step()  # a's tokens reach block 5: no block left
    assert harness.scheduler.waiting == [b] and [c[0] for c in chunks(plan)] == ["a"]
    assert chunks(plan)[0][3] == [0, 1, 4, 6, 7]  # 7 was b's last block, the LRU head
    assert (b.status, b.num_computed_tokens, b.num_preemptions) == (RequestStatus.PREEMPTED, 0, 1)
    assert harness.scheduler.num_preemptions == 1 and harness.scheduler.waiting == [b]
    assert len(harness.results["b"]) == 9
    harness.step()
    plan, results = harness.step()  # a finishes; b waits until it has
    assert [c[0] for c in chunks(plan)] == ["a"] and results[0].finish_reason == FinishReason.LENGTH
    plan, results = harness.step()
    # b recomputes prompt + 9 outputs, with its own first three blocks still cached.
    assert chunks(plan) == [("b", 12, 5, [2, 3, 5, 7, 6], True)]
    assert results[0].num_cached_tokens == -1
    assert (harness.scheduler.prefix_cache_queries, harness.scheduler.prefix_cache_hits) == (16, 0)
    harness.run()
    for request_id, prompt_len in (("a", 8), ("b", 8)):
        outputs = [t for r in harness.results[request_id] for t in r.new_token_ids]
        assert outputs == expected_outputs(prompt_len, 12)
    assert harness.manager.num_free_blocks == 8


def test_the_request_needing_a_block_is_preempted_when_it_is_the_newest():
    harness = Harness(num_blocks=5, max_model_len=20)
    harness.add("a", list(range(8)))
    b = harness.add("b", list(range(6)))
    for _ in range(3):
        harness.step()
        assert harness.scheduler.num_preemptions == 0
    plan, _ = harness.step()  # b's 9th token needs a third block; a holds the last free one
    assert harness.scheduler.waiting == [b] and harness.scheduler.num_preemptions == 1
    assert chunks(plan) == [("a", 10, 1, [0, 1, 4], True)]
    assert b.status == RequestStatus.PREEMPTED and b.num_output_tokens == 3


def test_abort_frees_blocks_at_once_and_skips_unknown_ids():
    harness = Harness(num_blocks=8, max_num_seqs=1, max_model_len=32)
    a = harness.add("a", list(range(10)))
    b = harness.add("b", [1, 2, 3])
    harness.step()
    assert harness.manager.num_free_blocks == 5
    assert harness.scheduler.abort(["a", "nope", "b"]) == [a, b]
    assert a.status == b.status == RequestStatus.FINISHED_ABORTED
    assert a.finish_reason == FinishReason.ABORT
    assert harness.manager.num_free_blocks == 8
    assert not harness.scheduler.has_unfinished and not harness.scheduler.has_request("a")
    assert harness.scheduler.num_running == harness.scheduler.num_waiting == 0
    assert harness.scheduler.abort(["a"]) == []
    harness.manager.check_invariants()


def test_abort_between_schedule_and_update_drops_the_chunk():
    harness = Harness()
    harness.add("a", list(range(10)))
    harness.add("b", list(range(5)))
    plan = harness.scheduler.schedule()
    harness.scheduler.abort(["a"])
    results = harness.scheduler.update(plan, {"a": 1, "b": 2})
    assert [(r.request.request_id, r.new_token_ids) for r in results] == [("b", [2])]
    assert harness.manager.slot_table("a") == []
    harness.manager.check_invariants()


# Prompt of 5 tokens: the fake model answers 105, 106, 100, 101, 102, 103, 104, 105, 106, ...
@pytest.mark.parametrize(
    "params, eos, max_model_len, outputs, reason",
    [
        ({}, 106, 64, [105, 106], FinishReason.STOP),
        ({"ignore_eos": True, "max_tokens": 4}, 106, 64, [105, 106, 100, 101], FinishReason.LENGTH),
        ({"min_tokens": 2}, 106, 64, [105, 106], FinishReason.STOP),
        ({"min_tokens": 3}, 106, 64, [105, 106, 100, 101, 102, 103, 104, 105, 106], FinishReason.STOP),
        ({"stop_token_ids": (100,)}, NO_EOS, 64, [105, 106, 100], FinishReason.STOP),
        ({"stop_token_ids": (100,), "ignore_eos": True}, 105, 64, [105, 106, 100], FinishReason.STOP),
        ({"max_tokens": 2}, 106, 64, [105, 106], FinishReason.STOP),  # a stop beats the length
        ({"max_tokens": 3}, NO_EOS, 64, [105, 106, 100], FinishReason.LENGTH),
        ({}, NO_EOS, 8, [105, 106, 100], FinishReason.LENGTH),  # max_model_len
    ],
)
def test_stop_conditions(params, eos, max_model_len, outputs, reason):
    harness = Harness(eos_token_ids=(eos,), max_model_len=max_model_len)
    request = harness.add("a", [1, 2, 3, 4, 5], **params)
    harness.run()
    results = harness.results["a"]
    assert [t for r in results for t in r.new_token_ids] == outputs
    assert [r.finish_reason for r in results] == [None] * (len(outputs) - 1) + [reason]
    assert request.is_finished and request.output_token_ids == outputs
    assert harness.manager.num_free_blocks == 64


@pytest.mark.parametrize(
    "prompt, params, hashes, message",
    [
        ([], {}, None, "empty"),
        (list(range(16)), {}, None, "max_model_len"),
        ([1, 2], {"max_tokens": 0}, None, "max_tokens"),
        ([1, 2, 3, 4, 5], {}, [b"x", b"y"], "block hashes"),
    ],
)
def test_add_refuses_bad_requests_without_breaking_the_loop(prompt, params, hashes, message):
    harness = Harness(max_model_len=16)
    request = harness.request("bad", prompt, **params)
    if hashes is not None:
        request.block_hashes = hashes
    with pytest.raises(ValueError, match=message):
        harness.scheduler.add(request)
    assert not harness.scheduler.has_unfinished
    harness.add("good", [1, 2], max_tokens=1)
    harness.run()
    assert harness.results["good"][0].finish_reason == FinishReason.LENGTH


def test_add_refuses_a_duplicate_request_id():
    harness = Harness()
    harness.add("a", [1, 2])
    assert harness.scheduler.has_request("a") and not harness.scheduler.has_request("b")
    with pytest.raises(ValueError, match="already in use"):
        harness.add("a", [3, 4])
    assert harness.scheduler.num_waiting == 1


def test_scheduler_refuses_a_pool_that_cannot_hold_max_model_len():
    with pytest.raises(ValueError, match="cannot hold"):
        Harness(num_blocks=3, max_model_len=16)


def test_with_prefix_caching_off_nothing_hits_or_counts():
    harness = Harness(enable_prefix_caching=False)
    for request_id in "ab":
        harness.add(request_id, list(range(12)), max_tokens=2)
        harness.run()
    assert [harness.results[i][0].num_cached_tokens for i in "ab"] == [0, 0]
    assert (harness.scheduler.prefix_cache_queries, harness.scheduler.prefix_cache_hits) == (0, 0)


def test_a_deferred_release_frees_the_blocks_after_the_results_or_at_the_next_schedule():
    harness = Harness(num_blocks=8, max_model_len=32)
    harness.scheduler.defer_release = True
    harness.add("a", list(range(10)), max_tokens=1)
    _, results = harness.step()
    assert [(r.request.request_id, r.finish_reason) for r in results] == [("a", FinishReason.LENGTH)]
    assert not harness.scheduler.has_unfinished and not harness.scheduler.has_request("a")
    assert harness.manager.num_free_blocks == 5  # still held: the deltas go out first
    assert harness.scheduler.abort(["a"]) == []  # finished: nothing to abort
    harness.scheduler.release_finished()
    assert harness.manager.num_free_blocks == 8
    harness.scheduler.release_finished()  # nothing left: a no-op
    assert harness.manager.num_free_blocks == 8
    # Not released by the caller: the next schedule frees them first; an id finished but not
    # yet released can be used again.
    harness.add("b", list(range(10)), max_tokens=1)
    harness.step()
    assert harness.manager.num_free_blocks == 5
    harness.add("b", list(range(10, 20)), max_tokens=1)
    assert harness.manager.num_free_blocks == 8
    harness.run()
    assert harness.manager.num_free_blocks == 5
    harness.scheduler.release_finished()
    assert harness.manager.num_free_blocks == 8
    harness.manager.check_invariants()


@pytest.mark.parametrize("defer_release", [False, True], ids=["release-at-once", "deferred-release"])
@pytest.mark.parametrize("seed", range(4))
def test_a_random_workload_under_block_pressure_produces_every_expected_token(seed, defer_release):
    rng = random.Random(seed)
    harness = Harness(num_blocks=12, max_num_seqs=4, max_num_batched_tokens=12, max_model_len=40)
    harness.scheduler.defer_release = defer_release
    prefixes = [[rng.randrange(50) for _ in range(n)] for n in (0, 5, 9)]
    expected = {}
    for step in range(200):
        if step < 60 and rng.random() < 0.3:
            prompt = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randint(1, 14))]
            max_tokens = rng.randint(1, 20)
            request_id = f"r{step}"
            harness.add(request_id, prompt, max_tokens=max_tokens)
            num_outputs = min(max_tokens, 40 - len(prompt))
            expected[request_id] = expected_outputs(len(prompt), num_outputs)
        harness.step()
    harness.run()
    outputs = {i: [t for r in results for t in r.new_token_ids] for i, results in harness.results.items()}
    assert outputs == expected
    assert harness.scheduler.num_preemptions > 0
    harness.scheduler.release_finished()
    assert harness.manager.num_free_blocks == 12
