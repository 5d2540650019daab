"""A served model with the CPU tier, as tools/bench/tier/served.py drives it: conversations' turns
round robin at bounded concurrency, and the tier's counters read from /metrics."""

from __future__ import annotations

import asyncio

import httpx

from spillway.tools.loadgen.server_metrics import parse_prometheus
from spillway.tools.bench.serve.stream_client import StreamTiming, stream_completion

SERVED_NAME = "bench"


def round_robin(conversations: list[list[list[int]]]) -> list[tuple[int, list[int]]]:
    """(turn index, prompt) of turn 1 of every conversation, then turn 2 of every one, ..."""
    return [(turn, conversation[turn]) for turn in range(len(conversations[0])) for conversation in conversations]


async def run_bounded(url: str, requests: list[tuple[int, list[int]]], output_len: int,
                      concurrency: int) -> list[tuple[int, StreamTiming]]:
    """Every request, at most `concurrency` at once, in order of submission (a conversation's
    turn t + 1 is submitted after its turn t, `concurrency` <= conversations keeps that true)."""
    gate = asyncio.Semaphore(concurrency)

    async def one(turn: int, prompt: list[int]) -> tuple[int, StreamTiming]:
        async with gate:
            return turn, await stream_completion(url, prompt, output_len, SERVED_NAME)

    return list(await asyncio.gather(*(one(turn, prompt) for turn, prompt in requests)))


def cpu_cached_tokens(url: str) -> float:
    """The server's prompt tokens served from the CPU tier so far (0 without the tier)."""
    return cpu_cached_in(httpx.get(url + "/metrics", timeout=10, trust_env=False).text)


def cpu_cached_in(metrics_text: str) -> float:
    return parse_prometheus(metrics_text).get('spillway:cached_tokens_total{source="cpu"}', 0.0)


def server_gauges(url: str) -> tuple[float, float]:
    """The CPU tier's usage (0-1) and the bytes stored to it so far."""
    return tier_gauges_in(httpx.get(url + "/metrics", timeout=10, trust_env=False).text)


def tier_gauges_in(metrics_text: str) -> tuple[float, float]:
    metrics = parse_prometheus(metrics_text)
    return (metrics.get("vllm:cpu_cache_usage_perc", 0.0),
            metrics.get('vllm:kv_offload_total_bytes_total{transfer_type="GPU_to_CPU"}', 0.0))
