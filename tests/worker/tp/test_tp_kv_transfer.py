"""Disaggregated prefill between tensor-parallel workers on the CPU (two gloo ranks each, a tiny
Qwen3 whose 2 KV heads are split): `LLM` with a prefill and a decode worker of two ranks each
generates what one two-rank worker does, every rank's share of each block moved; a producer and
a consumer of different sizes regroup the heads; a two-rank producer serves its tiers' blocks.
And each rank's share of a block, read and written in place."""

from __future__ import annotations

import pytest
import torch
import zmq
from kv_transfer_pair import BLOCK, generate, kv_engine, run, tokens
from tiny_models import save_tiny_qwen3

from spillway.gateway import LLM, SamplingParams
from spillway.protocol.kv_transfer import KvPull
from spillway.worker.core.readable_prefix import ReadablePrefix
from spillway.worker.kv_transfer.links import KvLinks
from spillway.worker.tp.kv_shards import rank_layout, read_own_share, write_own_share

PROMPTS = [[(11 * i + 7) % 250 + 2 for i in range(40)], [(5 * i + 3) % 250 + 2 for i in range(100)]]


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory) -> str:
    return save_tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3"))


def test_llm_with_two_rank_prefill_and_decode_workers_generates_what_a_two_rank_engine_does(tiny_qwen3):
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outputs = {}
    for name, arguments in (("one", {}), ("disaggregated", {"prefill_workers": 1, "decode_workers": 1})):
        with LLM(tiny_qwen3, tensor_parallel_size=2, device="cpu", max_model_len=256, **arguments) as llm:
            outputs[name] = [list(out.outputs[0].token_ids) for out in
                             llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)]
            if name == "disaggregated":
                stats = llm.stats()
    assert outputs["disaggregated"] == outputs["one"] and all(len(ids) == 8 for ids in outputs["one"])
    # Every full block but a last token's, each two ranks' shares of 2 layers x K and V x 16 tokens x 1 head x 16.
    block_bytes = 2 * (2 * 2 * BLOCK * 1 * 16 * 4)
    moved = sum((len(prompt) - 1) // BLOCK for prompt in PROMPTS) * block_bytes
    assert stats.kv_transfer_bytes_received == stats.kv_transfer_bytes_sent == moved
    assert stats.kv_transfer_failures == 0


@pytest.mark.parametrize("sizes", [(2, 1), (1, 2)], ids=["two-ranks-to-one", "one-to-two-ranks"])
def test_a_producer_and_a_consumer_of_different_sizes_regroup_the_heads(tiny_qwen3, tmp_path, sizes):
    """The consumer takes the blocks of a producer of another size, its 2 KV heads regrouped, and
    decodes what it computes alone."""
    producer_size, consumer_size = sizes
    ctx = zmq.Context()
    producer = kv_engine("kv_producer", num_blocks=16, model=tiny_qwen3, tensor_parallel_size=producer_size)
    consumer = kv_engine("kv_consumer", num_blocks=16, model=tiny_qwen3, tensor_parallel_size=consumer_size)
    producer_links, links = KvLinks(ctx, producer, f"ipc://{tmp_path}/kv", None), KvLinks(ctx, consumer, None, None)
    try:
        prompt, usable = PROMPTS[1], (len(PROMPTS[1]) - 1) // BLOCK
        expected = tokens(run(consumer, generate(consumer, "alone", prompt, 6)))
        assert consumer.reset_prefix_cache()
        run(producer, generate(producer, "prefill", prompt, 1))
        deltas = run(consumer, generate(consumer, "decode", prompt, 6, producer_links.address), links, producer_links)
        assert tokens(deltas) == expected and deltas[0].num_cached_tokens == usable * BLOCK
        assert producer.kv_layout.block_shape != consumer.kv_layout.block_shape
        assert consumer.stats().kv_transfer_bytes_received == usable * producer.kv_layout.block_bytes
        assert consumer.stats().kv_transfer_failures == 0
    finally:
        for link, engine in ((producer_links, producer), (links, consumer)):
            link.close()
            engine.close()
        ctx.destroy(linger=0)


def test_a_ranks_share_of_each_block_is_read_from_either_tier_and_written_in_place():
    pools = [torch.randn(6, 2, 2, 4, 1, 3) for _ in range(2)]  # two ranks' pools: [slots, layers, sides, block, heads, dim]
    tiers = [torch.randn(5, 2, 2, 4, 1, 3) for _ in range(2)]  # and their CPU tiers
    # Blocks 0 and 2 from GPU slots 4 and 2, block 1 from CPU slot 3.
    prefix = ReadablePrefix(3, gpu_reads=((4, 0), (2, 2)), cpu_reads=((3, 1),))
    shares = [read_own_share(pool, prefix, tier) for pool, tier in zip(pools, tiers)]
    for rank in range(2):
        read = [share.view(torch.float32).reshape(pools[rank][0].shape) for share in shares[rank]]
        assert torch.equal(read[0], pools[rank][4]) and torch.equal(read[1], tiers[rank][3])
        assert torch.equal(read[2], pools[rank][2])
    blocks = torch.stack(shares, dim=1)  # as rank 0 lays them out: a block's ranks one after another
    assert rank_layout(pools[0], 2).block_bytes == blocks[0].numel()
    targets = [torch.zeros_like(pool) for pool in pools]
    for rank, target in enumerate(targets):
        write_own_share(target, blocks, rank, 2, [0, 5, 3])
    for rank in range(2):
        assert torch.equal(targets[rank][0], pools[rank][4]) and torch.equal(targets[rank][5], tiers[rank][3])
        assert torch.equal(targets[rank][3], pools[rank][2])
        assert not targets[rank][[1, 2, 4]].any()


def test_a_two_rank_producer_serves_blocks_evicted_to_its_ranks_tiers_with_the_bytes_computed(tiny_qwen3):
    """Each rank's tier holds its share of the blocks the filler evicted: served from both tiers,
    the bytes are those both GPU pools served before the eviction."""
    engine = kv_engine("kv_producer", num_blocks=8, num_cpu_blocks=16, model=tiny_qwen3, tensor_parallel_size=2)
    try:
        prompt, usable = PROMPTS[1], (len(PROMPTS[1]) - 1) // BLOCK
        hashes = generate(engine, "x", prompt, 1).block_hashes[:usable]

        def served(transfer_id: str) -> tuple[ReadablePrefix, bytes]:
            engine.tier.stores_landed()
            prefix = engine.block_manager.readable_prefix(hashes)
            answer, payload = engine.serve_kv_pull(KvPull(transfer_id=transfer_id, block_hashes=hashes))
            assert answer.error == "" and answer.block_hashes == hashes
            return prefix, bytes(payload)

        run(engine, generate(engine, "prefill", prompt, 1))
        prefix, before = served("before")
        assert len(prefix.gpu_reads) == usable and len(before) == usable * engine.kv_layout.block_bytes
        run(engine, generate(engine, "filler", [(7 * i) % 240 + 5 for i in range(120)], 8))
        prefix, after = served("after")
        assert len(prefix.cpu_reads) == usable  # every one in the tiers only
        assert after == before
    finally:
        engine.close()
