"""The scheduler with client requests of several choices (`parent_id`, n > 1) beside a short
one: who is preempted when blocks run out, who is admitted, and the short request's chunk in
every step (worker/core/fair_share.py)."""

from __future__ import annotations

from tests.worker.core.test_scheduler import ROOT, Harness, chunks, expected_outputs

from spillway.protocol.hashing import block_hashes
from spillway.protocol.messages import Generate, SamplingParams
from spillway.worker.core.request import Request, RequestStatus


def add(harness: Harness, request_id: str, prompt: list[int], parent: str = "", max_tokens: int = 10) -> Request:
    msg = Generate(request_id=request_id, prompt_token_ids=prompt, block_hashes=block_hashes(prompt, 4, ROOT),
                   params=SamplingParams(max_tokens=max_tokens), parent_id=parent)
    harness.num_added += 1
    request = Request.from_generate(msg, arrival_index=harness.num_added)
    harness.scheduler.add(request)
    return request


def add_hog(harness: Harness, n: int, prompt: list[int], max_tokens: int = 10) -> list[Request]:
    return [add(harness, f"h-{i}", prompt, parent="h", max_tokens=max_tokens) for i in range(n)]


def ids(plan) -> list[str]:
    return [chunk.request.request_id for chunk in plan.chunks]


def run_checking_outputs(harness: Harness, lengths: dict[str, tuple[int, int]]) -> None:
    """Run to the end: every request's outputs are the fake model's for (prompt, max_tokens)."""
    harness.run()
    for request_id, (prompt_len, max_tokens) in lengths.items():
        outputs = [t for r in harness.results[request_id] for t in r.new_token_ids]
        assert outputs == expected_outputs(prompt_len, max_tokens), request_id
    assert harness.manager.num_free_blocks == harness.manager.num_gpu_blocks


def test_the_largest_holders_newest_choices_are_preempted_first_and_the_short_request_never():
    harness = Harness(num_blocks=8, max_model_len=32)
    h_0, h_1, h_2 = add_hog(harness, 3, [1, 2, 3, 4])
    short = add(harness, "s", [5, 6, 7, 8])
    plan, _ = harness.step()
    assert ids(plan) == ["h-0", "s", "h-1", "h-2"]  # s holds nothing when h holds one: it comes second
    for _ in range(4):  # each fills its second block: the pool's 8 are taken
        plan, _ = harness.step()
        assert ids(plan) == ["h-0", "h-1", "h-2", "s"]
    plan, _ = harness.step()  # everyone needs a third block
    # h-0 takes h-2's freed block 3 (h-2, h's newest, went first), s takes h-1's block 2, whose
    # chunk was dropped from the step; with one choice per parent left, h's two wait.
    assert chunks(plan) == [("h-0", 8, 1, [0, 4, 3], True), ("s", 8, 1, [1, 7, 2], True)]
    assert harness.scheduler.waiting == [h_1, h_2] and h_1.status == h_2.status == RequestStatus.PREEMPTED
    assert (h_0.num_preemptions, h_1.num_preemptions, h_2.num_preemptions, short.num_preemptions) == (0, 1, 1, 0)
    while not short.is_finished:
        plan, _ = harness.step()
        assert "s" in ids(plan)
    assert short.num_preemptions == 0 and len(harness.results["s"]) == 10
    run_checking_outputs(harness, {"h-0": (4, 10), "h-1": (4, 10), "h-2": (4, 10), "s": (4, 10)})


def test_a_short_request_beside_a_hog_holding_every_slot_and_block_takes_one_and_runs_every_step():
    harness = Harness(num_blocks=12, max_num_seqs=4, max_model_len=32)
    hog = add_hog(harness, 8, list(range(8)), max_tokens=12)
    for _ in range(3):
        plan, _ = harness.step()
        assert ids(plan) == ["h-0", "h-1", "h-2", "h-3"]  # every slot, 3 blocks each: the pool
    short = add(harness, "s", [40, 41, 42], max_tokens=4)
    plan, _ = harness.step()
    # h-3 (h's newest) gave s its slot and blocks: s's prompt runs in the step after it came.
    assert ids(plan) == ["h-0", "h-1", "h-2", "s"]
    assert plan.chunks[-1].num_tokens == 3 and hog[3].status == RequestStatus.PREEMPTED
    assert [r.request_id for r in harness.scheduler.waiting] == [f"h-{i}" for i in range(3, 8)]
    while not short.is_finished:
        plan, _ = harness.step()
        assert "s" in ids(plan)
    assert len(harness.results["s"]) == 4 and short.num_preemptions == 0
    run_checking_outputs(harness, {**{f"h-{i}": (8, 12) for i in range(8)}, "s": (3, 4)})


def test_a_hogs_long_prompts_take_their_share_of_the_step_and_a_short_prompt_runs_beside_them():
    harness = Harness(max_num_batched_tokens=16, max_model_len=48)
    add_hog(harness, 4, list(range(24)), max_tokens=6)
    short = add(harness, "s", [50, 51, 52, 53], max_tokens=6)
    plan, _ = harness.step()
    # Two client requests: 8 tokens each first; h-0's chunk is cut to its 8, s comes in whole,
    # and what the step has left (4) goes to h-1.
    assert [(c[0], c[1], c[2]) for c in chunks(plan)] == [("h-0", 0, 8), ("s", 0, 4), ("h-1", 0, 4)]
    while not short.is_finished:
        plan, _ = harness.step()
        assert "s" in ids(plan)
    assert len(harness.results["s"]) == 6
    run_checking_outputs(harness, {**{f"h-{i}": (24, 6) for i in range(4)}, "s": (4, 6)})
