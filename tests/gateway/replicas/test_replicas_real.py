"""Replicas of the real SmolLM2 on the CPU: `LLM(data_parallel_size=2)` generates what one
engine does, whatever replica each prompt lands on; `spillway serve -dp 2` keeps a chat's turns on
the replica that cached their history (its prefix-cache hits, the routing counters and each
engine's labelled metrics show it) and /health lists both replicas."""

from __future__ import annotations

import httpx
import pytest

from server_helpers import MODEL, engine_values, real_server
from spillway import LLM, SamplingParams

PROMPTS = [f"Tell me about the number {k} in one sentence." for k in range(6)]


@pytest.mark.slow
def test_two_replicas_generate_what_one_engine_does():
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    texts = {}
    for size in (1, 2):
        llm = LLM(data_parallel_size=size, routing="round-robin", max_model_len=256)
        try:
            texts[size] = [output.outputs[0].token_ids for output in llm.generate(PROMPTS, params, use_tqdm=False)]
        finally:
            llm.shutdown()
    assert texts[2] == texts[1] and all(len(ids) == 12 for ids in texts[1])


@pytest.mark.slow
def test_a_chats_turns_stay_on_the_replica_that_cached_them():
    with real_server("--data-parallel-size", "2", "--max-model-len", "1024") as server:
        assert httpx.get(server.url + "/health").json() == {"replicas": [{"engine": "0", "state": "ready"},
                                                                          {"engine": "1", "state": "ready"}]}
        history = [{"role": "system", "content": "You are a helpful assistant who answers briefly. " * 8}]
        for question in ("What is a river?", "And a lake?", "And the sea?"):
            history.append({"role": "user", "content": question})
            reply = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
                "model": MODEL, "messages": history, "max_tokens": 8, "temperature": 0.0}).json()
            history.append({"role": "assistant", "content": reply["choices"][0]["message"]["content"]})
        routed = engine_values(server.url, "spillway:routed_requests_total")
        by_engine = {engine: sum(v for (e, _), v in routed.items() if e == engine) for engine in ("0", "1")}
        assert sorted(by_engine.values()) == [0, 3]  # all three turns on one replica
        assert routed[(max(by_engine, key=by_engine.get), "prefix")] == 2  # turns 2 and 3 by their prefix
        hits = engine_values(server.url, "vllm:prefix_cache_hits_total")
        assert hits[(max(by_engine, key=by_engine.get),)] > 0 and hits[(min(by_engine, key=by_engine.get),)] == 0
