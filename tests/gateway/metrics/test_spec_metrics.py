"""The speculative-decoding counters on /metrics, under vLLM's names, from cumulative Stats."""

from __future__ import annotations

from spillway.gateway.metrics.metrics import GatewayMetrics
from spillway.protocol.messages import Stats


def sample_lines(metrics: GatewayMetrics) -> list[str]:
    return [line for line in metrics.render().decode().splitlines() if line.startswith("vllm:spec_decode")]


def test_spec_decode_counters_add_the_workers_increments():
    metrics = GatewayMetrics("m")
    metrics.engine(0).on_stats(Stats(spec_num_drafts=3, spec_num_draft_tokens=12, spec_num_accepted_tokens=7,
                                     spec_num_accepted_tokens_per_pos=[3, 2, 1, 1]))
    metrics.engine(0).on_stats(Stats(spec_num_drafts=5, spec_num_draft_tokens=20, spec_num_accepted_tokens=9,
                                     spec_num_accepted_tokens_per_pos=[4, 3, 1, 1]))
    metrics.engine(0).on_worker_lost()  # a fresh worker counts from zero again
    metrics.engine(0).on_stats(Stats(spec_num_drafts=1, spec_num_draft_tokens=4, spec_num_accepted_tokens=4,
                                     spec_num_accepted_tokens_per_pos=[1, 1, 1, 1]))
    assert sample_lines(metrics) == [
        'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 6.0',
        'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 24.0',
        'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 13.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 5.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 4.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="2"} 2.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="3"} 2.0',
    ]


def test_no_created_timestamps_are_exported():
    metrics = GatewayMetrics("m")
    metrics.engine(0).on_stats(Stats(spec_num_drafts=1, spec_num_draft_tokens=4, spec_num_accepted_tokens=4,
                                     spec_num_accepted_tokens_per_pos=[1, 1, 1, 1]))
    text = metrics.render().decode()
    assert "vllm:spec_decode_num_drafts_total" in text and "vllm:prompt_tokens_total" in text
    assert "_created" not in text
    assert text.endswith("\n")
