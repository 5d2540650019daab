"""Two producers (one with a CPU tier) and two consumers (kv_load_failure_policy "fail" and
"recompute", the latter with a CPU tier) on the default model, built once for the KV transfer tests
(an engine takes seconds to start on the CPU), each with its KV sockets over ipc:// in a private
folder."""

from __future__ import annotations

import tempfile

import pytest
import zmq
from kv_transfer_pair import kv_engine

from spillway.worker.kv_transfer.links import KvLinks

PRODUCER_BLOCKS = 8  # one request of max_model_len fills it: a long one evicts every cached block
CONSUMER_BLOCKS = 16


@pytest.fixture(scope="package")
def ctx():
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


@pytest.fixture(scope="package")
def folder():
    with tempfile.TemporaryDirectory(prefix="spillway-kv-") as path:  # short: ipc paths are bounded
        yield path


@pytest.fixture(scope="package")
def producer(ctx, folder):
    engine = kv_engine("kv_producer", num_blocks=PRODUCER_BLOCKS)
    links = KvLinks(ctx, engine, f"ipc://{folder}/kv", None)
    yield engine, links
    links.close()
    engine.close()


@pytest.fixture(scope="package")
def tiered_producer(ctx, folder):
    # Its GPU pool as small as the other's, a CPU tier twice that: what a long request evicts
    # from the pool stays in the tier, and is served from there.
    engine = kv_engine("kv_producer", num_blocks=PRODUCER_BLOCKS, num_cpu_blocks=2 * PRODUCER_BLOCKS)
    links = KvLinks(ctx, engine, f"ipc://{folder}/kv-tiered", None)
    yield engine, links
    links.close()
    engine.close()


def _consumer(ctx, policy: str, num_cpu_blocks: int = 0):
    engine = kv_engine("kv_consumer", num_blocks=CONSUMER_BLOCKS, policy=policy, num_cpu_blocks=num_cpu_blocks)
    return engine, KvLinks(ctx, engine, None, None)


@pytest.fixture(scope="package")
def consumer(ctx):
    engine, links = _consumer(ctx, "fail")
    yield engine, links
    links.close()
    engine.close()


@pytest.fixture(scope="package")
def recomputing_consumer(ctx):
    # A CPU tier of 2 blocks: full after a few steps, so an eviction writes back a block that has no copy yet.
    engine, links = _consumer(ctx, "recompute", num_cpu_blocks=2)
    yield engine, links
    links.close()
    engine.close()
