"""worker/driver/timing.py: the deadlines, budgets and paces derived from the decode step and the
copy rate a worker measures, and how the engine's parts get them (host only)."""

from __future__ import annotations

import pytest
import torch

from spillway.protocol.config import WorkerConfig
from spillway.worker.driver.engine import Engine
from spillway.worker.driver.tier_driver import NullTierDriver, write_ahead_blocks
from spillway.worker.driver.timing import (REFERENCE_COPY_BYTES_PER_S, REFERENCE_DECODE_STEP_S, LandingDeadlines,
                                           LinkTiming, StepTiming)
from spillway.worker.kv_tier.host_pool import time_host_to_device

MiB = 2**20
QWEN3_8B_BLOCK_BYTES = 36 * 2 * 16 * 8 * 128 * 2  # 2.25 MiB: 36 layers, 16 tokens, 8 KV heads of 128, bf16


def test_the_h200s_measurements_give_the_values_sized_there():
    step = StepTiming.derive(REFERENCE_DECODE_STEP_S)
    assert step.landing == LandingDeadlines(plan_before_landing_s=0.006, plan_overlapped_s=0.02,
                                            arrivals_quiet_s=0.003, arrivals_deadline_s=0.014, hold_in_flight_s=0.002)
    assert (step.drain_budget_s, step.landing_drain_budget_s, step.load_burst_s) == (0.002, 0.005, 0.01)
    link = LinkTiming.derive(REFERENCE_COPY_BYTES_PER_S)
    assert link == LinkTiming(load_speed_guess=45e9, write_ahead_bytes=128 * MiB, idle_write_ahead_bytes=128 * MiB)


def test_a_step_twice_as_long_doubles_every_deadline_budget_and_the_burst():
    step = StepTiming.derive(2 * REFERENCE_DECODE_STEP_S)
    assert step.landing == LandingDeadlines(plan_before_landing_s=0.012, plan_overlapped_s=0.04,
                                            arrivals_quiet_s=0.006, arrivals_deadline_s=0.028, hold_in_flight_s=0.004)
    assert (step.drain_budget_s, step.landing_drain_budget_s, step.load_burst_s) == (0.004, 0.01, 0.02)


def test_a_step_half_as_long_halves_them():
    step = StepTiming.derive(REFERENCE_DECODE_STEP_S / 2)
    assert step.landing == LandingDeadlines(plan_before_landing_s=0.003, plan_overlapped_s=0.01,
                                            arrivals_quiet_s=0.0015, arrivals_deadline_s=0.007, hold_in_flight_s=0.001)
    assert (step.drain_budget_s, step.landing_drain_budget_s, step.load_burst_s) == (0.001, 0.0025, 0.005)


def test_a_link_half_as_fast_halves_the_speed_guess_and_the_bytes_written_back():
    assert LinkTiming.derive(REFERENCE_COPY_BYTES_PER_S / 2) == LinkTiming(
        load_speed_guess=22.5e9, write_ahead_bytes=64 * MiB, idle_write_ahead_bytes=64 * MiB)
    assert LinkTiming.derive(4 * REFERENCE_COPY_BYTES_PER_S) == LinkTiming(
        load_speed_guess=180e9, write_ahead_bytes=512 * MiB, idle_write_ahead_bytes=512 * MiB)


@pytest.mark.parametrize("measured", [0.0, -1.0, float("nan")])
def test_a_measurement_that_is_no_time_or_no_rate_is_refused(measured):
    with pytest.raises(ValueError, match="must be positive"):
        StepTiming.derive(measured)
    with pytest.raises(ValueError, match="must be positive"):
        LinkTiming.derive(measured)


def test_a_slower_link_writes_fewer_blocks_back_ahead_of_eviction_a_step():
    def blocks(copy_bytes_per_s: float) -> int:
        return write_ahead_blocks(QWEN3_8B_BLOCK_BYTES, LinkTiming.derive(copy_bytes_per_s).write_ahead_bytes)

    assert blocks(REFERENCE_COPY_BYTES_PER_S) == 56  # 128 MiB of 2.25 MiB blocks
    assert blocks(REFERENCE_COPY_BYTES_PER_S / 2) == 28
    assert blocks(4 * REFERENCE_COPY_BYTES_PER_S) == 64  # at most: the scheduler walks 4x that into the LRU each step


def test_the_copy_rate_is_timed_on_the_cpu_too():
    rate = time_host_to_device(torch.device("cpu"))
    assert 1e6 < rate < 1e13  # a memory copy: between a megabyte and ten terabytes a second


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-llama")
    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def test_the_engine_derives_its_timing_from_what_it_measured_and_hands_each_part_its_values(model_dir, monkeypatch):
    from spillway.worker.driver import engine as engine_module
    from spillway.worker.runner import executor_start

    monkeypatch.setattr(executor_start, "time_decode_step", lambda runner: 3 * REFERENCE_DECODE_STEP_S)
    monkeypatch.setattr(engine_module, "time_host_to_device", lambda device: REFERENCE_COPY_BYTES_PER_S / 2)
    engine = Engine(WorkerConfig(model=str(model_dir), device="cpu", dtype="float32", max_num_seqs=4,
                                 num_gpu_blocks_override=4, num_cpu_blocks_override=8))
    assert engine.timing == StepTiming.derive(3 * REFERENCE_DECODE_STEP_S)
    assert engine.tier.deadlines == engine.timing.landing
    assert engine.tier.deadlines.arrivals_deadline_s == pytest.approx(0.042)
    assert engine.tier.idle_write_ahead_bytes == 64 * MiB
    assert engine.scheduler.write_ahead_blocks == 64  # the tiny model's blocks: the most a step takes
    copier = engine.executor.kv_copier
    assert copier.load_speed() == copier.load_speed_guess == 22.5e9  # no load timed yet
    assert copier.pending_loads.bytes_per_s == 26e9  # the setting's, whatever was measured


def test_without_a_tier_the_engine_times_its_step_and_not_the_link(model_dir, monkeypatch):
    from spillway.worker.driver import engine as engine_module

    def no_link(device):
        raise AssertionError("the link is timed for a CPU tier only")

    monkeypatch.setattr(engine_module, "time_host_to_device", no_link)
    engine = Engine(WorkerConfig(model=str(model_dir), device="cpu", dtype="float32", max_num_seqs=4,
                                 num_gpu_blocks_override=4))
    assert type(engine.tier) is NullTierDriver
    assert engine.timing.drain_budget_s > 0
