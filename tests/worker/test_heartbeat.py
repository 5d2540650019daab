"""The worker's heartbeat thread beats through a long stage of its busy loop and says how long
that stage has run."""

from __future__ import annotations

import time

import zmq

from spillway.protocol.messages import StepOutputs, worker_decoder
from spillway.worker.heartbeat import Heartbeat


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

