import msgspec
import pytest

from spillway.protocol.messages import (
    Abort, Control, ControlCommand, FinishReason, Generate, KvEvents, Ready, RequestDelta, SamplingParams,
    StepOutputs, Stats, TokenLogprobs, WorkerError, encoder, gateway_decoder, worker_decoder,
)


def test_gateway_messages_round_trip_through_the_tagged_union():
    enc, dec = encoder(), gateway_decoder()
    msgs = [
        Generate(request_id="r1", prompt_token_ids=[1, 2, 3], block_hashes=[b"\x01" * 16],
                 params=SamplingParams(max_tokens=5, temperature=0.0, stop_token_ids=(7,)),
                 cache_salt="s"),
        Abort(["r1", "r2"]),
        Control(ControlCommand.SHUTDOWN),
    ]
    for msg in msgs:
        assert dec.decode(enc.encode(msg)) == msg


def test_worker_messages_round_trip():
    enc, dec = encoder(), worker_decoder()
    delta = RequestDelta(request_id="r1", new_token_ids=[5], finish_reason=FinishReason.LENGTH,
                         logprobs=[TokenLogprobs(5, -0.1, 1, [5, 6], [-0.1, -2.5])], num_cached_tokens=16)
    msgs = [
        StepOutputs(step=3, outputs=[delta], stats=Stats(num_running=1, prefix_cache_hits=16)),
        WorkerError(message="boom", fatal=True),
        Ready(protocol_version=1, model="m", block_size=16, hash_seed=b"x", num_gpu_blocks=10,
              num_cpu_blocks=0, max_model_len=2048, max_num_seqs=8, max_num_batched_tokens=512,
              vocab_size=100, eos_token_ids=[2], device="cpu", dtype="float32"),
    ]
    for msg in msgs:
        assert dec.decode(enc.encode(msg)) == msg


def test_a_message_on_the_wrong_socket_fails_loudly():
    with pytest.raises(msgspec.ValidationError):
        worker_decoder().decode(encoder().encode(Abort(["r1"])))


class StepOutputsBeforeKvEvents(msgspec.Struct, frozen=True, tag="StepOutputs", kw_only=True):
    """StepOutputs as a peer built before `kv_events` existed sends and reads it."""

    step: int
    outputs: list[RequestDelta]
    stats: Stats | None = None
    iteration_s: float | None = None


def test_step_outputs_with_and_without_kv_events_round_trip():
    enc, dec = encoder(), worker_decoder()
    events = KvEvents(stored=[b"\x01" * 16, b"\x02" * 16], removed=[b"\x03" * 16])
    msgs = [
        StepOutputs(step=4, outputs=[RequestDelta(request_id="r1", new_token_ids=[5])], kv_events=events),
        StepOutputs(step=5, outputs=[], stats=Stats(num_running=0),
                    kv_events=KvEvents(stored=[], removed=[], cleared=True)),
        StepOutputs(step=6, outputs=[RequestDelta(request_id="r1", new_token_ids=[6])]),
    ]
    for msg in msgs:
        assert dec.decode(enc.encode(msg)) == msg
    # Compact: a report is an array of [stored, removed, cleared], no field names.
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(events)) == [[b"\x01" * 16, b"\x02" * 16],
                                                                      [b"\x03" * 16], False]


def test_step_outputs_decode_across_peers_with_and_without_kv_events():
    old = StepOutputsBeforeKvEvents(step=3, outputs=[RequestDelta(request_id="r1", new_token_ids=[5])],
                                    stats=Stats(num_steps=3))
    assert worker_decoder().decode(encoder().encode(old)) == StepOutputs(step=3, outputs=old.outputs,
                                                                         stats=Stats(num_steps=3))
    new = StepOutputs(step=3, outputs=old.outputs, kv_events=KvEvents(stored=[b"\x01" * 16], removed=[]))
    # An older gateway reading a newer worker's message skips the field it does not know.
    assert msgspec.msgpack.decode(encoder().encode(new), type=StepOutputsBeforeKvEvents) == \
        StepOutputsBeforeKvEvents(step=3, outputs=old.outputs)
