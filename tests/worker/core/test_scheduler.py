"""The scheduler driven by a fake model: token budget, batch order, stop conditions, refusals."""

from __future__ import annotations

import pytest

from spillway.protocol.hashing import DEFAULT_HASH_SEED, block_hashes, root_hash
from spillway.protocol.messages import FinishReason, Generate, SamplingParams
from spillway.worker.core.block_manager import BlockManager
from spillway.worker.core.request import Request
from spillway.worker.core.scheduler import Scheduler, StepPlan, StepResult

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
                 max_model_len=64, enable_prefix_caching=True, eos_token_ids=(NO_EOS,), defer_release=False):
        self.block_size = block_size
        self.manager = BlockManager(num_blocks, block_size, enable_prefix_caching)
        self.scheduler = Scheduler(
            self.manager, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len, block_size=block_size, root_hash=ROOT,
            eos_token_ids=list(eos_token_ids), defer_release=defer_release,
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
