"""Async scheduling (worker/driver/pipeline.py: commit one step later) gives the same outputs as
stepping synchronously, through the one step pipeline.

Both engines run in this process on the CPU over the same tiny random Qwen3; the async one
launches each decode step before reading the step before, feeding the pending tokens on
the device. Requests arrive mid-run, stop on tokens while a step is in flight, end by
length, get aborted, ask for logprobs (which forces synchronous steps), and get preempted.
"""

from __future__ import annotations

import random

import msgspec
import pytest
import torch

from spillway.protocol.hashing import block_hashes
from spillway.protocol.messages import FinishReason, Generate, SamplingParams
from spillway.worker.runner.device_settings import WorkerConfig
from spillway.worker.driver.engine import Engine
from tiny_models import TINY_VOCAB, TinyCheckpoints, save_tiny_qwen3, save_tiny_qwen3_moe

VOCAB = TINY_VOCAB


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> TinyCheckpoints:
    return TinyCheckpoints(tmp_path_factory.mktemp("tiny-async"),
                           {"qwen3": save_tiny_qwen3, "qwen3_moe": save_tiny_qwen3_moe})


@pytest.fixture
def tiny_model(request, checkpoints) -> str:
    """A tiny random Qwen3; a tiny Qwen3-MoE where a test asks for "qwen3_moe" (indirect)."""
    return checkpoints[getattr(request, "param", "qwen3")]


DENSE_AND_MOE = pytest.mark.parametrize("tiny_model", ["qwen3", "qwen3_moe"], indirect=True)


def make_engine(path: str, async_scheduling: bool, **overrides) -> Engine:
    config = dict(model=path, dtype="float32", device="cpu", max_num_seqs=8, async_scheduling=async_scheduling)
    config.update(overrides)
    return Engine(WorkerConfig(**config))


def drive(engine: Engine, arrivals: dict[int, list[tuple[str, list[int], SamplingParams]]],
          aborts: dict[int, list[str]] | None = None) -> dict[str, tuple[list[int], FinishReason]]:
    """Add requests / abort them before the given step numbers; step until idle."""
    tokens: dict[str, list[int]] = {}
    finished: dict[str, FinishReason] = {}
    aborts = aborts or {}
    step = 0
    while engine.has_work or any(s >= step for s in arrivals):
        for request_id, prompt, params in arrivals.get(step, []):
            hashes = block_hashes(prompt, engine.block_size, engine.root_hash)
            assert engine.add_request(Generate(request_id=request_id, prompt_token_ids=prompt,
                                               block_hashes=hashes, params=params)) is None
            tokens[request_id] = []
        deltas = engine.abort(aborts[step]) if step in aborts else []
        deltas += engine.step()
        for delta in deltas:
            assert delta.request_id not in finished, f"{delta.request_id} got tokens after it finished"
            tokens[delta.request_id] += delta.new_token_ids
            if delta.finish_reason is not None:
                finished[delta.request_id] = delta.finish_reason
        step += 1
        assert step < 2000
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_gpu_blocks - sum(
        1 for b in engine.block_manager.blocks if b.ref_count > 0)
    return {request_id: (tokens[request_id], finished[request_id]) for request_id in tokens}


def prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, VOCAB) for _ in range(rng.randrange(1, 40))] for _ in range(count)]


def both(path, arrivals, aborts=None, **overrides):
    sync = make_engine(path, False, **overrides)
    ahead = make_engine(path, True, **overrides)
    expected, got = drive(sync, arrivals, aborts), drive(ahead, arrivals, aborts)
    assert sync.num_async_steps == 0
    assert ahead.num_async_steps > 0
    return expected, got, ahead


@DENSE_AND_MOE
def test_greedy_outputs_and_finish_reasons_equal_synchronous_stepping(tiny_model):
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    batch = prompts(10, seed=1)
    arrivals = {0: [(f"a{i}", p, greedy) for i, p in enumerate(batch[:6])],
                7: [(f"b{i}", p, SamplingParams(temperature=0.0, max_tokens=5 + i, ignore_eos=True))
                    for i, p in enumerate(batch[6:])]}
    expected, got, _ = both(tiny_model, arrivals)
    assert got == expected
    assert all(reason == FinishReason.LENGTH for _, reason in got.values())
    assert [len(tokens) for tokens, _ in got.values()] == [24] * 6 + [5, 6, 7, 8]


def test_stop_tokens_seen_while_the_next_step_is_in_flight(tiny_model):
    """Each request stops on a token it produces mid-run: the step launched ahead of that
    token wasted a row, which must not leak a token or a block."""
    batch = prompts(6, seed=2)
    free_run = drive(make_engine(tiny_model, False),
                     {0: [(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
                          for i, p in enumerate(batch)]})
    arrivals = {0: []}
    for i, prompt in enumerate(batch):
        tokens = free_run[f"r{i}"][0]
        stop = tokens[3 + i]  # a token it will produce; its first occurrence ends the request
        params = SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[stop], ignore_eos=True)
        arrivals[0].append((f"r{i}", prompt, params))
    expected, got, _ = both(tiny_model, arrivals)
    assert got == expected
    assert all(reason == FinishReason.STOP for _, reason in got.values())
    assert all(len(tokens) <= 4 + i for i, (tokens, _) in enumerate(got.values()))


def test_seeded_sampling_equals_synchronous_stepping(tiny_model):
    batch = prompts(6, seed=3)
    arrivals = {0: [(f"s{i}", p, SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=100 + i,
                                                 max_tokens=20, ignore_eos=True))
                    for i, p in enumerate(batch[:4])],
                3: [(f"t{i}", p, SamplingParams(temperature=1.2, seed=7 + i, max_tokens=12))
                    for i, p in enumerate(batch[4:])]}
    expected, got, _ = both(tiny_model, arrivals)
    assert got == expected


@DENSE_AND_MOE
def test_prompts_chunked_into_running_decodes_run_ahead_with_the_same_outputs(tiny_model):
    """Steps of 24 tokens: long prompts arriving mid-run are computed in chunks beside the
    running decodes; those mixed steps run ahead too (their decodes fed on the device)."""
    rng = random.Random(9)
    long_prompts = [[rng.randrange(2, VOCAB) for _ in range(50 + 7 * i)] for i in range(3)]
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    seeded = SamplingParams(temperature=0.9, seed=11, max_tokens=15, ignore_eos=True)
    arrivals = {0: [(f"d{i}", p, greedy) for i, p in enumerate(prompts(3, seed=10))],
                4: [(f"p{i}", p, seeded if i % 2 else greedy) for i, p in enumerate(long_prompts)]}
    sync, ahead = (make_engine(tiny_model, mode, max_num_batched_tokens=24) for mode in (False, True))
    mixed = []
    mark_in_flight = ahead.scheduler.mark_in_flight

    def record(plan):
        if any(not chunk.sample for chunk in plan.chunks) and any(chunk.num_tokens == 1 for chunk in plan.chunks):
            mixed.append(plan)
        mark_in_flight(plan)

    ahead.scheduler.mark_in_flight = record
    expected, got = drive(sync, arrivals), drive(ahead, arrivals)
    assert got == expected
    assert len(mixed) >= 3  # a prompt chunk beside decodes, launched before the step before was read


def test_logprobs_penalties_and_min_tokens_fall_back_to_synchronous_steps(tiny_model):
    batch = prompts(4, seed=4)
    arrivals = {0: [("plain", batch[0], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))],
                4: [("logprobs", batch[1], SamplingParams(temperature=0.0, max_tokens=6, logprobs=3,
                                                          ignore_eos=True)),
                    ("penalty", batch[2], SamplingParams(temperature=0.0, max_tokens=6, repetition_penalty=1.3,
                                                         ignore_eos=True)),
                    ("min", batch[3], SamplingParams(temperature=0.0, max_tokens=8, min_tokens=5))]}
    expected, got, ahead = both(tiny_model, arrivals)
    assert got == expected


def test_abort_while_a_step_is_in_flight(tiny_model):
    batch = prompts(4, seed=5)
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    arrivals = {0: [(f"r{i}", p, greedy) for i, p in enumerate(batch)]}
    expected, got, ahead = both(tiny_model, arrivals, aborts={6: ["r1"], 9: ["r3", "unknown"]})
    for request_id in ("r0", "r2"):
        assert got[request_id] == expected[request_id]
    for request_id in ("r1", "r3"):
        # Tokens come back one call later, so fewer had arrived when the abort came; the
        # token of the step in flight is dropped with the request.
        tokens, reason = got[request_id]
        assert reason == expected[request_id][1] == FinishReason.ABORT
        assert 0 < len(tokens) < len(expected[request_id][0])
        assert tokens == expected[request_id][0][: len(tokens)]
    assert not ahead.has_work


def test_preemption_in_a_small_pool(tiny_model):
    """18 blocks of 16 tokens for 6 requests growing to ~70 tokens: steps run out of blocks and
    preempt, those planned ahead too (the victim's token in flight is kept). Half the requests
    sample with a seed: a token drawn and dropped would shift what their seeds give."""
    batch = prompts(6, seed=6)
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    arrivals = {0: [(f"r{i}", p, greedy if i % 2 else SamplingParams(temperature=1.0, seed=i, max_tokens=40,
                                                                       ignore_eos=True))
                    for i, p in enumerate(batch)]}
    expected, got, ahead = both(tiny_model, arrivals, num_gpu_blocks_override=18, max_model_len=128)
    assert ahead.scheduler.counts.num_preemptions > 0
    assert got == expected


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_with_graphs_greedy_and_stop_tokens_equal_synchronous_stepping(tiny_model):
    batch = prompts(12, seed=7)
    cuda = dict(device="cuda", dtype="bfloat16", max_num_seqs=16, num_gpu_blocks_override=512)
    free_run = drive(make_engine(tiny_model, False, **cuda),
                     {0: [(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
                          for i, p in enumerate(batch)]})
    arrivals = {0: [], 5: []}
    for i, prompt in enumerate(batch):
        stop = free_run[f"r{i}"][0][2 * i + 1]
        params = SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[stop] if i % 2 else [],
                                ignore_eos=True)
        arrivals[0 if i < 8 else 5].append((f"r{i}", prompt, params))
    expected, got, ahead = both(tiny_model, arrivals, **cuda)
    assert ahead.runner.cuda_graphs.decode is not None
    assert got == expected


def test_a_thinking_budget_forces_its_end_marker_among_steps_that_run_ahead(tiny_model):
    """A request under a thinking budget never runs ahead (the forced token depends on the
    committed state); its neighbours do, and the budget still closes thinking on time."""
    from spillway.protocol.reasoning import ThinkingPolicy

    end = 3
    batch = prompts(3, seed=8)
    policy = ThinkingPolicy(start_token_ids=(2,), end_token_ids=(end,), budget=4, prompt_opened=True)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    arrivals = {0: [("plain", batch[0], greedy), ("other", batch[1], greedy)], 2: [("think", batch[2], greedy)]}
    sync, ahead = make_engine(tiny_model, False), make_engine(tiny_model, True)
    for engine in (sync, ahead):
        original = engine.add_request
        engine.add_request = lambda msg, original=original: original(
            msg if msg.request_id != "think" else msgspec.structs.replace(msg, thinking=policy))
    expected, got = drive(sync, arrivals), drive(ahead, arrivals)
    assert got == expected and ahead.num_async_steps > 0
    thinking_tokens = got["think"][0]
    assert end in thinking_tokens[:5] and len(thinking_tokens) == 12


def test_a_step_the_device_has_finished_is_committed_before_the_next_is_planned(tiny_model, monkeypatch):
    """When the step in flight is done (its tokens copied), running ahead of the idle device
    gains nothing: it is committed first, the next plan is made with every token known, and
    the outputs stay those of synchronous stepping. (On the CPU no step is ever 'finished'
    early: there the async engine plans ahead, as the tests above show.)"""
    from spillway.worker.driver.pipeline import LaunchedStep

    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    batch = prompts(6, seed=3)
    arrivals = {0: [(f"a{i}", p, greedy) for i, p in enumerate(batch[:3])],
                4: [(f"b{i}", p, greedy) for i, p in enumerate(batch[3:])]}
    expected = drive(make_engine(tiny_model, False), arrivals)
    monkeypatch.setattr(LaunchedStep, "finished", lambda step: True)
    engine = make_engine(tiny_model, True)
    planned_ahead = []
    schedule = engine.scheduler.schedule
    engine.scheduler.schedule = lambda ahead=False, lookahead=0, **options: (
        planned_ahead.append(ahead), schedule(ahead, lookahead, **options))[1]
    assert drive(engine, arrivals) == expected
    assert engine.num_async_steps > 0  # plans still run ahead of their commit
    assert planned_ahead and not any(planned_ahead)  # but never ahead of a finished step
