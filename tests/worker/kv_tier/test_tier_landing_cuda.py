"""The engine with a CPU tier on a GPU, planning steps before their loads land
(worker/driver/tier_driver.py): the step's forward queued behind the loads' events, a burst's late
member behind the step still in flight. The tiny model and helpers of test_cpu_tier_engine.py."""

from __future__ import annotations

import pytest
import torch

from spillway.protocol.config import WorkerConfig
from spillway.protocol.messages import Generate, SamplingParams
from spillway.worker.driver.engine import Engine
from tests.worker.kv_tier.test_cpu_tier_engine import GREEDY, SEEDED, checkpoints, model_dir, run  # noqa: F401 (fixtures)


def cuda_engine(model_dir, num_gpu_blocks: int, num_cpu_blocks: int) -> Engine:
    engine = Engine(WorkerConfig(model=str(model_dir), device="cuda", dtype="float32", max_num_seqs=4,
                                 num_gpu_blocks_override=num_gpu_blocks, num_cpu_blocks_override=num_cpu_blocks))
    engine.debug_invariants = True
    return engine


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("slice_bytes", [1 << 30, 1], ids=["whole-blocks", "by-layer"])
def test_turn_2_planned_before_its_loads_land_waits_for_them_on_the_device(model_dir, params, slice_bytes,
                                                                           monkeypatch):
    """The device is asked after every load and says "not landed" (a slow link): with nothing
    else to run and the loads due within the lead, the engine plans turn 2 anyway, its forward
    queued behind the loads' events, layer by layer where the loads go a layer at a time; the
    tokens are those of a pool that kept the blocks. The landing is reported later, and the
    CPU copies are held until then."""
    from spillway.worker.kv_tier import paced_loads

    monkeypatch.setattr(paced_loads, "MIN_SLICE_BYTES", slice_bytes)
    monkeypatch.setattr(paced_loads, "segment_size", lambda num_layers: 1)  # the model has 2 layers: a group each
    engine, reference = cuda_engine(model_dir, 4, 8), cuda_engine(model_dir, 64, 0)
    copier = engine.executor.kv_copier
    runner, layer_waits = engine.executor.runner, []
    execute = runner.execute
    monkeypatch.setattr(runner, "execute", lambda *args, layer_ready=None, **kwargs: (
        layer_waits.append(layer_ready), execute(*args, layer_ready=layer_ready, **kwargs))[1])
    reported = copier.landed_through
    held = {"on": False}
    monkeypatch.setattr(copier, "landed_through", lambda wait=False: (
        copier._landed_through if held["on"] and not wait else reported(wait)))
    turn_1 = [(7 * i) % 90 + 1 for i in range(32)]
    expected = {"turn-1": run(reference, "turn-1", turn_1, params)}
    assert run(engine, "turn-1", turn_1, params) == expected["turn-1"]
    filler = [(5 * i) % 90 + 2 for i in range(63)]
    assert run(engine, "filler", filler, params) == run(reference, "filler", filler, params)
    turn_2 = turn_1 + expected["turn-1"][0] + [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    held["on"] = True
    plans = []
    assert engine.add_request(Generate(request_id="turn-2", prompt_token_ids=turn_2, block_hashes=[],
                                       params=params)) is None
    tokens = []
    while engine.has_work:
        for delta in engine.step():
            tokens += delta.new_token_ids
        plans.append(engine.last_plan)
    early = [plan for plan in plans if plan.chunks and plan.kv_copies.wait_for_loads]
    assert len(early) == 1 and early[0].chunks[0].start == 32  # the history came from the tier
    assert early[0].kv_copies.wait_by_layer
    waited = [waits for waits in layer_waits if waits is not None]
    num_layers = runner.kv_cache.shape[1]
    assert [len(waits) for waits in waited] == ([num_layers] if slice_bytes == 1 else [])
    assert engine.block_manager.tier.num_loading == 2  # never reported landed: still held
    held["on"] = False
    engine.step() if engine.has_work else engine.tier.before_step()
    assert engine.block_manager.tier.num_loading == 0
    assert tokens == run(reference, "turn-2", turn_2, params)[0]
    engine.block_manager.check_invariants()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_late_member_is_planned_behind_the_early_step_still_in_flight(model_dir, monkeypatch):
    """A burst's first member computes in a step planned before its loads land; a second
    member on the same prefix arrives while that step is on the device (it never says
    "finished" here, and the loads "land" in 10 ms): the engine leaves the step in flight
    rather than wait for its token, plans the second member behind it once arrivals stop,
    and only then reads the first member's token. Both answers are a full pool's."""
    from spillway.worker.kv_tier import paced_loads
    from spillway.worker.driver.pipeline import LaunchedStep
    from spillway.worker.driver.timing import REFERENCE_DECODE_STEP_S
    from spillway.worker.runner import executor_start

    # The scenario's times (loads landing in 10 ms) are on the scale of the reference model's
    # step, whose deadlines plan before a landing 10 ms away; this tiny model's own step would
    # scale them down to a fraction of a millisecond.
    monkeypatch.setattr(executor_start, "time_decode_step", lambda runner: REFERENCE_DECODE_STEP_S)
    monkeypatch.setattr(paced_loads, "MIN_SLICE_BYTES", 1)  # loads by layer, as a large model's go
    monkeypatch.setattr(paced_loads, "segment_size", lambda num_layers: 1)
    one = SamplingParams(max_tokens=1, temperature=0.0)
    engine, reference = cuda_engine(model_dir, 4, 8), cuda_engine(model_dir, 64, 0)
    copier = engine.executor.kv_copier
    reported, held = copier.landed_through, {"on": True}
    turn_1 = [(7 * i) % 90 + 1 for i in range(32)]
    tokens, _ = run(engine, "turn-1", turn_1, GREEDY)
    run(engine, "filler", [(5 * i) % 90 + 2 for i in range(63)], GREEDY)  # turn 1 only in the tier now
    first, second = turn_1 + tokens + [3, 1, 4], turn_1 + tokens + [2, 7, 1]
    monkeypatch.setattr(copier, "loads_land_in", lambda: 0.010)
    monkeypatch.setattr(copier, "landed_through", lambda wait=False: (  # the device says "not landed"
        copier._landed_through if held["on"] and not wait else reported(wait)))
    assert engine.add_request(Generate(request_id="first", prompt_token_ids=first, block_hashes=[], params=one)) is None
    engine.step()  # its loads queued
    monkeypatch.setattr(LaunchedStep, "finished", lambda self: False)
    assert engine.step() == [] and engine.last_plan.kv_copies.wait_for_loads  # planned before the landing
    early = engine._in_flight
    assert engine.add_request(Generate(request_id="second", prompt_token_ids=second, block_hashes=[],
                                       params=one)) is None
    assert engine.step() == [] and engine._in_flight is early and engine.waits_for_loads  # held: still arriving
    engine.scheduler.last_received -= 1.0  # no request since: arrivals have stopped
    deltas = engine.step()
    assert [d.request_id for d in deltas] == ["first"] and deltas[0].num_cached_tokens == 32
    assert [chunk.request.request_id for chunk in engine.last_plan.chunks] == ["second"]
    assert engine.last_plan.kv_copies.wait_for_loads and engine._in_flight is not early
    outputs = {d.request_id: d.new_token_ids for d in deltas}
    held["on"] = False
    while engine.has_work:
        outputs.update({d.request_id: d.new_token_ids for d in engine.step()})
    run(reference, "turn-1", turn_1, GREEDY)
    assert outputs == {"first": run(reference, "first", first, one)[0], "second": run(reference, "second", second, one)[0]}
    engine.block_manager.check_invariants()
