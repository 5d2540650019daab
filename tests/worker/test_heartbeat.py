"""The worker's heartbeat thread beats through a long stage of its busy loop and says how long
that stage has run; a step's tokens are counted as vLLM's vllm:iteration_tokens_total counts them."""

from __future__ import annotations

import time

import zmq

from spillway.protocol.messages import RequestDelta, SamplingParams, StepOutputs, worker_decoder
from spillway.worker.heartbeat import Heartbeat
from spillway.worker.core.request import Request
from spillway.worker.driver.stats import step_tokens
from spillway.worker.core.step_plan import ScheduledChunk, StepPlan


def test_beats_go_on_through_a_long_stage_and_say_how_long_it_has_run(tmp_path):
    ctx = zmq.Context()
    try:
        gateway = ctx.socket(zmq.PULL)
        gateway.bind(f"ipc://{tmp_path}/out")
        beat = Heartbeat(ctx, [f"ipc://{tmp_path}/out"], interval_s=0.05).start()
        beat.stage_started()
        time.sleep(0.6)  # the loop's thread busy (a long step): it sends nothing itself
        beat.stage_started()  # the next stage
        time.sleep(0.2)
        beat.stop()
        decoder = worker_decoder()
        beats = []
        while gateway.poll(0):
            beats.append(decoder.decode(gateway.recv()))
    finally:
        ctx.destroy(linger=0)

    assert len(beats) >= 12  # ~16 in 0.8 s, none lost to the long stage
    assert all(isinstance(b, StepOutputs) and b.step == -1 and b.outputs == [] and b.stats is None for b in beats)
    spans = [b.iteration_s for b in beats]
    longest = max(range(len(spans)), key=spans.__getitem__)
    assert 0.5 <= spans[longest] < 0.7  # the long stage, as it ended
    assert spans[:longest + 1] == sorted(spans[:longest + 1])  # growing through it
    assert all(span < 0.3 for span in spans[longest + 1:]) and len(spans) > longest + 1  # the next stage's own


def request(request_id: str, num_prompt_tokens: int) -> Request:
    return Request(request_id=request_id, prompt=list(range(num_prompt_tokens)), params=SamplingParams(),
                   block_hashes=[], arrival_index=0)


def chunk(req: Request, start: int, num_tokens: int) -> ScheduledChunk:
    return ScheduledChunk(request=req, start=start, num_tokens=num_tokens, slot_table=[], sample=True)


def test_a_step_counts_the_prompt_tokens_it_computes_and_the_tokens_it_generated():
    prefill, decode, recompute = request("a", 100), request("b", 50), request("c", 50)
    plan = StepPlan(chunks=[
        chunk(prefill, 64, 36),  # the prompt's last chunk: 36 prompt tokens, then its first token
        chunk(decode, 60, 1),  # past its prompt: the token it computes was generated before
        chunk(recompute, 40, 20),  # preempted and recomputed: 10 prompt tokens, 10 generated ones
    ], num_batched_tokens=57)
    deltas = [RequestDelta(request_id="a", new_token_ids=[7]), RequestDelta(request_id="b", new_token_ids=[8]),
              RequestDelta(request_id="c", new_token_ids=[9])]
    assert step_tokens(plan, deltas) == 36 + 10 + 3
    # A step that only commits the one run ahead before it (its plan held: no chunks).
    assert step_tokens(StepPlan(chunks=[], num_batched_tokens=0), deltas[:2]) == 2
    assert step_tokens(None, []) == 0
