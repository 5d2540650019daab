"""The gateway's side of disaggregated prefill and decode (gateway/replicas/prefill_decode.py)
over fake workers (tests/gateway/fake_worker.py) placed by `place_prefill_decode`, each writing
the Generates and Aborts it takes to a file: a prompt goes to a producer as a one-token request,
then to a consumer with the producer's KV address, the client hearing only the consumer; a short
prompt skips the producer; an abort at each stage reaches the side that holds the request and
leaves nothing tracked; a lost producer or consumer ends the request with its error, at once; a
consumer lost before answering hands the decode to another; without a ready producer the
consumer computes the prompt itself."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest

from fake_worker import FakeWorkerProcess, fake_kv_address, recorded
from server_helpers import MODEL
from spillway.gateway.link.client import WorkerLost
from spillway.gateway.replicas.placement import place_prefill_decode
from spillway.gateway.replicas.prefill_decode import PREFILL_SUFFIX, PrefillDecodeSet, prefill_request
from spillway.protocol.config import WorkerConfig
from spillway.protocol.kv_transfer import KvTransferConfig
from spillway.protocol.messages import FinishReason, Generate, KvSource, SamplingParams, StructuredKind, \
    StructuredOutput
from spillway.protocol.reasoning import ThinkingPolicy

BLOCK = 16
SCRIPT = list(range(100, 200))
HOLD = 30.0  # a fake worker holding its first request this long: a prefill or a pull still running
DEADLINE_S = 10.0


class Workers:
    """The fake workers' factories (producers first, as placed), each one's record file, and the
    set over them."""

    def __init__(self, folder: Path, num_prefill: int = 1, num_decode: int = 1, *, holds=None, steps=None,
                 restart_delay_s: float = 0.0) -> None:
        config = WorkerConfig(model="fake", served_model_name=MODEL, max_model_len=512, max_num_seqs=8)
        self.placement = place_prefill_decode(config, num_prefill, num_decode, gpus=[], num_cores=2)
        count = num_prefill + num_decode
        self.files = [folder / f"record-{k}" for k in range(count)]
        self.holds = holds or [0.0] * count
        self.steps = steps or [0.002] * count
        self.num_prefill = num_prefill
        self.restart_delay_s = restart_delay_s
        self.started = [0] * count

    def start(self, k: int):
        if self.started[k]:
            time.sleep(self.restart_delay_s)  # a replacement takes a while, as a real one does
        self.started[k] += 1
        launch = self.placement.launches[k]
        return FakeWorkerProcess(launch.config, SCRIPT, step_s=self.steps[k], hold_s=self.holds[k], beat=True,
                                 record_path=str(self.files[k]))

    def build(self) -> PrefillDecodeSet:
        starts = [lambda k=k: self.start(k) for k in range(len(self.files))]
        return PrefillDecodeSet(starts[:self.num_prefill], starts[self.num_prefill:], max_num_seqs=8)

    def record(self, k: int) -> list[dict]:
        return recorded(self.files[k])


def generate(request_id: str, num_blocks: int = 2, max_tokens: int = 3, parent: str = "req", **params) -> Generate:
    tokens = list(range(1, num_blocks * BLOCK + 5))
    return Generate(request_id=request_id, prompt_token_ids=tokens,
                    block_hashes=[bytes([k + 1]) * 16 for k in range(num_blocks)],
                    params=SamplingParams(max_tokens=max_tokens, temperature=0.0, **params), parent_id=parent)


def run(workers: Workers, body):
    """`body(set)` on a started set, on an event loop of its own; the set closed after."""

    async def main():
        workers_set = workers.build()
        try:
            await workers_set.start()
            return await body(workers_set)
        finally:
            await workers_set.close()

    return asyncio.run(main())


async def until(condition, timeout_s: float = DEADLINE_S):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def drain(stream, request_ids) -> dict[str, list]:
    """Every delta of `request_ids` until each has finished: {id: [deltas]}."""
    seen = {rid: [] for rid in request_ids}
    open_ids = set(request_ids)
    while open_ids:
        for delta in await asyncio.wait_for(stream.next(), DEADLINE_S):
            seen[delta.request_id].append(delta)
            if delta.finish_reason is not None:
                open_ids.discard(delta.request_id)
    return seen


def nothing_tracked(workers_set: PrefillDecodeSet, stream) -> bool:
    return workers_set.num_in_flight == 0 and stream.num_tracked == 0


def test_the_prefill_request_asks_one_token_and_nothing_of_the_output():
    original = generate("r-0-0", max_tokens=50, min_tokens=4, logprobs=2, prompt_logprobs=1, ignore_eos=False,
                        structured=StructuredOutput(kind=StructuredKind.REGEX, spec="a+"))
    original = Generate(**{**{f: getattr(original, f) for f in original.__struct_fields__},
                           "thinking": ThinkingPolicy(start_token_ids=(1,), end_token_ids=(2,), budget=8), "priority": 3,
                           "cache_salt": "salt", "kv_source": KvSource(address="tcp://elsewhere:1")})
    prefill = prefill_request(original)
    assert prefill.request_id == "r-0-0" + PREFILL_SUFFIX
    assert (prefill.params.max_tokens, prefill.params.min_tokens, prefill.params.logprobs,
            prefill.params.prompt_logprobs, prefill.params.structured, prefill.params.ignore_eos) == (1, 0, None, None,
                                                                                                    None, True)
    assert (prefill.thinking, prefill.kv_source) == (None, None)
    same = ("prompt_token_ids", "block_hashes", "priority", "cache_salt", "parent_id")
    assert all(getattr(prefill, f) == getattr(original, f) for f in same)


def test_a_prompt_is_prefilled_by_a_producer_then_decoded_by_a_consumer_with_its_address(tmp_path):
    workers = Workers(tmp_path)

    async def body(workers_set):
        ids = ["r-0-0", "r-0-1"]  # one prompt, n=2
        stream = workers_set.submit([generate(rid, logprobs=1) for rid in ids], num_samples=2)
        seen = await drain(stream, ids)
        await until(lambda: nothing_tracked(workers_set, stream))
        producer_pid = workers_set.producers.replicas[0].link.worker_pid
        return seen, producer_pid

    seen, producer_pid = run(workers, body)
    prefills, decodes = workers.record(0), workers.record(1)
    assert prefills == [{"generate": "r-0-0-prefill", "max_tokens": 1, "min_tokens": 0, "ignore_eos": True,
                         "logprobs": None, "structured": False, "thinking": False, "kv_source": None,
                         "block_hashes": 2, "parent_id": "req"}]
    assert [(d["generate"], d["max_tokens"], d["logprobs"], d["kv_source"]) for d in decodes] == [
        ("r-0-0", 3, 1, fake_kv_address(producer_pid)), ("r-0-1", 3, 1, fake_kv_address(producer_pid))]
    for rid, deltas in seen.items():  # only the consumer's deltas, its three tokens each
        assert [t for d in deltas for t in d.new_token_ids] == SCRIPT[:3]
        assert deltas[-1].finish_reason is FinishReason.LENGTH and all(d.logprobs for d in deltas)


def test_a_prompt_shorter_than_a_block_skips_the_producer(tmp_path):
    workers = Workers(tmp_path)

    async def body(workers_set):
        stream = workers_set.submit([generate("r-0-0", num_blocks=2), generate("r-1-0", num_blocks=0)])
        await drain(stream, ["r-0-0", "r-1-0"])

    run(workers, body)
    assert [d["generate"] for d in workers.record(0)] == ["r-0-0-prefill"]
    decodes = {d["generate"]: d["kv_source"] for d in workers.record(1)}
    assert decodes["r-1-0"] is None and decodes["r-0-0"].startswith("ipc://")
    assert list(decodes) == ["r-1-0", "r-0-0"]  # the short one at once, the other once prefilled


def test_an_abort_during_the_prefill_reaches_the_producer_only(tmp_path):
    workers = Workers(tmp_path, holds=[HOLD, 0.0])

    async def body(workers_set):
        stream = workers_set.submit([generate("r-0-0")])
        await until(lambda: workers.record(0))
        stream.close()
        await until(lambda: len(workers.record(0)) == 2)
        stats = await workers_set.stats(DEADLINE_S)
        return nothing_tracked(workers_set, stream), stats.num_running

    assert run(workers, body) == (True, 0)
    assert workers.record(0)[1] == {"abort": ["r-0-0-prefill"]} and workers.record(1) == []


def test_an_abort_between_prefill_and_decode_reaches_the_consumer(tmp_path):
    # The consumer holds the request as a real one does while it pulls the prompt's blocks.
    workers = Workers(tmp_path, holds=[0.0, HOLD])

    async def body(workers_set):
        stream = workers_set.submit([generate("r-0-0")])
        await until(lambda: workers.record(1))
        stream.close()
        await until(lambda: len(workers.record(1)) == 2)
        stats = await workers_set.stats(DEADLINE_S)
        return nothing_tracked(workers_set, stream), stats.num_running

    assert run(workers, body) == (True, 0)
    assert [d.get("abort") for d in workers.record(0)] == [None]  # the prefill had finished: nothing to abort
    assert workers.record(1)[1] == {"abort": ["r-0-0"]}


def test_a_finished_sample_and_then_an_abort_during_the_decode_reach_the_consumer(tmp_path):
    workers = Workers(tmp_path, steps=[0.002, 0.05])

    async def body(workers_set):
        stream = workers_set.submit([generate("r-0-0", max_tokens=80), generate("r-0-1", max_tokens=80)], 2)
        deltas = await asyncio.wait_for(stream.next(), DEADLINE_S)
        assert deltas and all(d.new_token_ids for d in deltas)
        stream.finish("r-0-0", "stop")  # a stop string ended it in the gateway
        await until(lambda: {"abort": ["r-0-0"]} in workers.record(1))
        stream.close()
        await until(lambda: {"abort": ["r-0-1"]} in workers.record(1))
        return nothing_tracked(workers_set, stream)

    assert run(workers, body)
    assert [d.get("abort") for d in workers.record(0)] == [None]


def _kill(client) -> None:
    os.kill(client.link.worker_pid, signal.SIGKILL)


def test_a_producer_lost_during_the_prefill_ends_the_request_with_its_error(tmp_path):
    workers = Workers(tmp_path, holds=[HOLD, 0.0])

    async def body(workers_set):
        stream = workers_set.submit([generate("r-0-0")])
        await until(lambda: workers.record(0))
        _kill(workers_set.producers.replicas[0])
        killed = time.monotonic()
        with pytest.raises(WorkerLost) as lost:
            await asyncio.wait_for(stream.next(), DEADLINE_S)
        return str(lost.value), time.monotonic() - killed, nothing_tracked(workers_set, stream)

    message, seconds, clean = run(workers, body)
    assert "prefill worker" in message and "SIGKILL" in message and seconds < 5 and clean
    assert [entry for entry in workers.record(1) if "kv_source_lost" not in entry] == []  # no decode went out


def test_a_producer_lost_after_its_prefill_is_named_to_the_consumers(tmp_path):
    """The consumer pulling that producer's blocks hears of the loss at once (KvSourceLost), so its
    pull fails by its policy instead of waiting for an answer that cannot come."""
    workers = Workers(tmp_path, holds=[0.0, HOLD])

    async def body(workers_set):
        stream = workers_set.submit([generate("r-0-0")])
        await until(lambda: workers.record(1))  # the decode went out: the consumer pulls meanwhile
        address = workers_set.producers.replicas[0].ready.kv_address
        _kill(workers_set.producers.replicas[0])
        await until(lambda: any("kv_source_lost" in entry for entry in workers.record(1)))
        stream.close()
        return address

    address = run(workers, body)
    assert {"kv_source_lost": address} in workers.record(1) and workers.record(1)[0]["kv_source"] == address


def test_a_consumer_lost_mid_decode_ends_the_request_with_its_error(tmp_path):
    workers = Workers(tmp_path, steps=[0.002, 0.05])

    async def body(workers_set):
        stream = workers_set.submit([generate("r-0-0", max_tokens=80)])
        await asyncio.wait_for(stream.next(), DEADLINE_S)
        _kill(workers_set.consumers.replicas[0])
        with pytest.raises(WorkerLost) as lost:
            while True:
                await asyncio.wait_for(stream.next(), DEADLINE_S)
        return str(lost.value), nothing_tracked(workers_set, stream)

    message, clean = run(workers, body)
    assert "decode worker" in message and "SIGKILL" in message and clean


def test_a_consumer_lost_before_answering_hands_the_decode_to_another(tmp_path):
    workers = Workers(tmp_path, num_decode=2, holds=[0.0, HOLD, 0.0])

    async def body(workers_set):
        stream = workers_set.submit([generate("r-0-0")])
        await until(lambda: workers.record(1))  # decode 0 (least loaded, first in turn) holds it
        _kill(workers_set.consumers.replicas[0])
        return await drain(stream, ["r-0-0"])

    seen = run(workers, body)
    assert [t for d in seen["r-0-0"] for t in d.new_token_ids] == SCRIPT[:3]
    first, second = workers.record(1)[0], workers.record(2)[0]
    assert first["generate"] == second["generate"] == "r-0-0"
    assert second["kv_source"] == first["kv_source"] is not None


def test_a_consumer_lost_before_answering_with_none_to_take_over_ends_the_request(tmp_path):
    workers = Workers(tmp_path, holds=[0.0, HOLD])

    async def body(workers_set):
        stream = workers_set.submit([generate("r-0-0")])
        await until(lambda: workers.record(1))
        _kill(workers_set.consumers.replicas[0])
        with pytest.raises(WorkerLost, match="decode worker"):
            await asyncio.wait_for(stream.next(), DEADLINE_S)
        return nothing_tracked(workers_set, stream)

    assert run(workers, body)


def test_without_a_ready_producer_the_consumer_computes_the_prompt(tmp_path):
    workers = Workers(tmp_path, restart_delay_s=3.0)

    async def body(workers_set):
        _kill(workers_set.producers.replicas[0])
        await until(lambda: not workers_set.producers.healthy)
        stream = workers_set.submit([generate("r-0-0")])
        seen = await drain(stream, ["r-0-0"])
        return seen

    seen = run(workers, body)
    assert seen["r-0-0"][-1].finish_reason is FinishReason.LENGTH
    decodes = [entry for entry in workers.record(1) if "generate" in entry]
    assert workers.record(0) == [] and decodes[0]["kv_source"] is None


def test_a_worker_in_the_wrong_role_is_refused_at_start(tmp_path):
    workers = Workers(tmp_path)
    config = WorkerConfig(model="fake", served_model_name=MODEL, max_model_len=512,
                          kv_transfer=KvTransferConfig(kv_connector="HostConnector", kv_role="kv_consumer"))
    workers_set = PrefillDecodeSet([lambda: FakeWorkerProcess(config, SCRIPT)], [lambda: workers.start(1)],
                                   max_num_seqs=8)

    async def main():
        try:
            await workers_set.start()
        finally:
            await workers_set.close()

    with pytest.raises(RuntimeError, match="prefill 0's worker has the KV transfer role 'kv_consumer'"):
        asyncio.run(main())
