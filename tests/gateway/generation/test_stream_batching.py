"""A stream behind the worker gets the steps it missed in one SSE event; one that keeps up
gets each token alone. Driven without sockets: the deltas go straight into the request's
RequestStream, as the client's reader task puts them."""

from __future__ import annotations

import asyncio
import json

import pytest
from prometheus_client import CollectorRegistry, Histogram

from spillway.gateway.link.client import RequestStream, WorkerLost
from spillway.gateway.text.detok import IncrementalDetokenizer, ids_decoder
from spillway.gateway.generation.jobs import Job, Prompt
from spillway.gateway.metrics.metrics import observe_repeated
from spillway.gateway.api.logprob_answers import TokenStrings
from spillway.gateway.http.responses import completion_events
from spillway.gateway.api.sampling_params import SamplingParams
from spillway.gateway.generation.serving import Generation, merge_deltas
from spillway.gateway.text.tokenizer import PromptTokenizer
from spillway.protocol.local import model_files
from spillway.protocol.messages import FinishReason, RequestDelta, TokenLogprobs

TEXT = "Hello world, how are you"


@pytest.fixture(scope="module")
def tokenizer():
    return model_files.load_tokenizer(model_files.resolve_model(None))


@pytest.fixture(scope="module")
def token_ids(tokenizer) -> list[int]:
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    assert len(ids) == 6  # Hello | world | , | how | are | you
    return ids


class _Client:
    """EngineClient's two calls a Generation makes: submit and abort."""

    def __init__(self) -> None:
        self.stream: RequestStream | None = None
        self.aborted: list[str] = []

    def submit(self, generates, num_samples: int = 1) -> RequestStream:
        self.stream = RequestStream(self, [g.request_id for g in generates])
        return self.stream

    def abort(self, request_ids, reason: str = "abort") -> None:
        self.aborted += request_ids


def start(tokenizer, max_tokens: int, stop: list[str] | None = None) -> tuple[Generation, _Client, str]:
    params = SamplingParams(max_tokens=max_tokens, stop=stop, ignore_eos=True)
    job = Job(request_id="cmpl-test", chat=False, model="m", prompts=[Prompt([1, 2, 3])], params=params,
              max_tokens=[max_tokens], stream=True, include_usage=True, continuous_usage=True)
    client = _Client()
    generation = Generation(job, client, PromptTokenizer(tokenizer), lambda ids, salt: [])
    generation.start()
    return generation, client, "cmpl-test-0-0"


def delta(request_id: str, token_id: int, finish: FinishReason | None = None) -> RequestDelta:
    return RequestDelta(request_id=request_id, new_token_ids=[token_id], finish_reason=finish)


def event(raw: bytes) -> dict:
    assert raw.startswith(b"data: ") and raw.endswith(b"\n\n")
    return json.loads(raw[6:-2])


def split(batch: bytes) -> list[bytes]:
    """The SSE events of one write, each with its blank line."""
    assert batch.endswith(b"\n\n")
    return [raw + b"\n\n" for raw in batch[:-2].split(b"\n\n")]


def text_and_tokens(raw: bytes) -> tuple[str, int]:
    body = event(raw)
    return body["choices"][0]["text"], body["usage"]["completion_tokens"]


def test_a_stream_behind_gets_every_waiting_step_in_one_event(tokenizer, token_ids):
    async def run() -> list[bytes]:
        generation, client, rid = start(tokenizer, 6)
        stream = client.stream
        for token_id in token_ids[:4]:  # four steps arrived while the handler was busy
            stream.put(delta(rid, token_id))
        events = completion_events(generation, TokenStrings(tokenizer))
        first = await anext(events)
        stream.put(delta(rid, token_ids[4]))
        stream.put(delta(rid, token_ids[5], FinishReason.LENGTH))
        return [first] + [e async for e in events]

    batches = asyncio.run(run())
    # One write per batch: the last carries the finish and the usage with its text.
    assert [len(split(batch)) for batch in batches] == [1, 3]
    events = [raw for batch in batches for raw in split(batch)]
    assert text_and_tokens(events[0]) == ("Hello world, how", 4)
    assert text_and_tokens(events[1]) == (" are you", 6)
    finish = event(events[2])
    assert finish["choices"][0]["finish_reason"] == "length" and finish["choices"][0]["text"] == ""
    usage = event(events[3])
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 6
    assert usage["usage"]["total_tokens"] == 9
    assert len(events) == 4


def test_a_stream_that_keeps_up_gets_one_token_per_event(tokenizer, token_ids):
    async def run() -> list[tuple[str, int]]:
        generation, client, rid = start(tokenizer, 6)
        stream = client.stream
        events = completion_events(generation, TokenStrings(tokenizer))
        seen = []
        for index, token_id in enumerate(token_ids[:5]):
            stream.put(delta(rid, token_id))
            seen.append(text_and_tokens(await anext(events)))
            assert index + 1 == seen[-1][1]
        return seen

    assert asyncio.run(run()) == [("Hello", 1), (" world", 2), (",", 3), (" how", 4), (" are", 5)]


def test_with_stop_strings_the_tokens_after_the_stop_are_not_counted(tokenizer, token_ids):
    async def run() -> list[bytes]:
        generation, client, rid = start(tokenizer, 6, stop=[","])
        for token_id in token_ids[:4]:  # "," is the third token; the fourth came with it
            client.stream.put(delta(rid, token_id))
        batches = [e async for e in completion_events(generation, TokenStrings(tokenizer))]
        assert client.aborted == [rid]  # the gateway stopped it in the worker
        return batches

    batches = asyncio.run(run())
    assert len(batches) == 1  # one batch of deltas: one write
    events = split(batches[0])
    assert len(events) == 3
    assert text_and_tokens(events[0]) == ("Hello world", 3)
    assert event(events[1])["choices"][0]["finish_reason"] == "stop"
    assert event(events[2])["usage"]["completion_tokens"] == 3


def test_merge_joins_each_requests_consecutive_token_deltas():
    lp = [TokenLogprobs(7, -0.5, 1, [], []), TokenLogprobs(8, -0.25, 1, [], [])]
    deltas = [
        RequestDelta(request_id="a", new_token_ids=[7], logprobs=lp[:1], num_cached_tokens=16),
        RequestDelta(request_id="b", new_token_ids=[1]),
        RequestDelta(request_id="a", new_token_ids=[8], logprobs=lp[1:]),
        RequestDelta(request_id="b", new_token_ids=[], finish_reason=FinishReason.ABORT),
        RequestDelta(request_id="a", new_token_ids=[9], finish_reason=FinishReason.STOP),
        RequestDelta(request_id="a", new_token_ids=[10]),
    ]
    assert merge_deltas(deltas) == [
        RequestDelta(request_id="a", new_token_ids=[7, 8, 9], finish_reason=FinishReason.STOP, logprobs=lp,
                     num_cached_tokens=16),
        RequestDelta(request_id="b", new_token_ids=[1]),
        RequestDelta(request_id="b", new_token_ids=[], finish_reason=FinishReason.ABORT),
        RequestDelta(request_id="a", new_token_ids=[10]),  # after a finish: kept apart (and ignored)
    ]


def test_merge_keeps_a_lone_delta_and_an_error_as_they_are():
    error = RequestDelta(request_id="a", new_token_ids=[3], finish_reason=FinishReason.ERROR, error="no")
    deltas = [RequestDelta(request_id="a", new_token_ids=[2]), error]
    assert merge_deltas(deltas) == deltas
    assert merge_deltas(deltas[:1])[0] is deltas[0]


def test_request_stream_hands_over_everything_that_arrived():
    async def run() -> tuple[list, list]:
        stream = RequestStream(_Client(), ["a"])
        waiting = asyncio.ensure_future(stream.next())
        await asyncio.sleep(0)
        stream.put(delta("a", 1))
        stream.put(delta("a", 2))
        first = await waiting
        stream.put(delta("a", 3))
        return first, await stream.next()

    first, second = asyncio.run(run())
    assert [d.new_token_ids for d in first] == [[1], [2]]
    assert [d.new_token_ids for d in second] == [[3]]


def test_request_stream_raises_worker_lost_after_the_deltas_before_it():
    async def run() -> None:
        stream = RequestStream(_Client(), ["a"])
        stream.put(delta("a", 1))
        stream.put(WorkerLost("gone"))
        await stream.next()

    with pytest.raises(WorkerLost, match="gone"):
        asyncio.run(run())


def test_backend_decode_matches_the_tokenizers_decode(tokenizer):
    decode = ids_decoder(tokenizer)
    assert decode.__name__ == "through_backend"
    cases = [[], [1], [1, 2, 3], list(range(40000, 40040)), [2, 17, 2, 900]]
    for ids in cases:
        for skip in (True, False):
            assert decode(ids, skip) == tokenizer.decode(ids, skip_special_tokens=skip)


def test_other_tokenizers_decode_through_their_own_decode():
    class Spaces:
        clean_up_tokenization_spaces = True

        def decode(self, ids, skip_special_tokens=False):
            return f"{ids}:{skip_special_tokens}"

    decode = ids_decoder(Spaces())
    assert decode.__name__ == "through_transformers"
    assert decode([4, 5], True) == "[4, 5]:True"


def test_repeated_observation_equals_as_many_observations():
    def histogram() -> Histogram:
        return Histogram("gap", "gap", buckets=(0.25, 1.0), registry=CollectorRegistry())

    once, each = histogram(), histogram()
    observe_repeated(once, 0.5, 3)
    observe_repeated(once, 2.0, 1)
    for amount in (0.5, 0.5, 0.5, 2.0):
        each.observe(amount)
    samples = [(s.name, s.labels, s.value) for s in once.collect()[0].samples if not s.name.endswith("_created")]
    assert samples == [(s.name, s.labels, s.value) for s in each.collect()[0].samples
                       if not s.name.endswith("_created")]
    assert ("gap_sum", {}, 3.5) in samples and ("gap_bucket", {"le": "1.0"}, 3.0) in samples


def test_tokens_together_that_end_inside_a_character_give_the_whole_characters_before_it(tokenizer):
    ids = tokenizer("Hi 😀 there", add_special_tokens=False)["input_ids"]
    assert ids == [26843, 40303, 218, 665]  # Hi | " " + the emoji's first bytes | its last byte | there
    apart = IncrementalDetokenizer(tokenizer, [1, 2, 3])
    assert [apart.push([i]) for i in ids] == ["Hi", "", " 😀", " there"]
    together = IncrementalDetokenizer(tokenizer, [1, 2, 3])
    assert together.push(ids[:2]) == "Hi"  # not held back with the partial emoji
    assert together.push(ids[2:]) == " 😀 there"
    assert together.flush() == ""
