"""Token-id prompts on /v1/completions: checked, truncated and packed for the wire by the
JobBuilder, with every refusal as it was before the ids were packed on intake (the shape first,
then the lengths, then the vocabulary)."""

from __future__ import annotations

import asyncio
import json
from array import array

import pytest

from spillway.gateway.api import openai as api
from spillway.gateway.generation.jobs import JobBuilder
from spillway.gateway.api.prompt_ids import PROMPT_SHAPES
from spillway.protocol.hashing import pack_token_ids
from spillway.protocol.messages import PROTOCOL_VERSION, Ready

VOCAB = 49152
MAX_MODEL_LEN = 256
READY = Ready(protocol_version=PROTOCOL_VERSION, model="m", block_size=16, hash_seed=b"", num_gpu_blocks=64,
              num_cpu_blocks=0, max_model_len=MAX_MODEL_LEN, max_num_seqs=8, max_num_batched_tokens=256,
              vocab_size=VOCAB, eos_token_ids=[2], device="cpu", dtype="float32")
OUT_OF_VOCAB = f"prompt token ids must lie in [0, {VOCAB})"


def completion(prompt, **fields):
    """The Job of a /v1/completions body, built as the server builds it (no tokenizer: ids only)."""
    body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": 4, **fields}).encode()
    builder = JobBuilder(None, ["m"], lambda: READY)
    return asyncio.run(builder.completion_job(api.decode_request(body, api.CompletionRequest)))


def refusal(prompt, **fields) -> tuple[str, str | None, str | None]:
    with pytest.raises(api.ApiError) as caught:
        completion(prompt, **fields)
    assert caught.value.status == 400
    return caught.value.message, caught.value.param, caught.value.code


def test_a_token_id_prompt_is_packed_once_as_the_wire_carries_it():
    ids = [0, 7, 300, 65, VOCAB - 1] * 30
    [prompt] = completion(ids).prompts
    assert list(prompt.token_ids) == ids and prompt.text is None
    assert prompt.packed == pack_token_ids(ids)


def test_a_checked_prompt_keeps_its_ids_in_4_bytes_each_not_as_the_decoded_list():
    ids = list(range(1000, 1200))
    [prompt] = completion(ids).prompts
    assert isinstance(prompt.token_ids, array) and prompt.token_ids.itemsize == 4
    assert prompt.token_ids.tolist() == ids
    assert list(prompt.token_ids[-5:]) == ids[-5:]  # as the detokenizer takes its context


def test_several_id_lists_are_each_packed():
    job = completion([[5, 6], [7, VOCAB - 1, 9]])
    assert [list(p.token_ids) for p in job.prompts] == [[5, 6], [7, VOCAB - 1, 9]]
    assert [p.packed for p in job.prompts] == [pack_token_ids([5, 6]), pack_token_ids([7, VOCAB - 1, 9])]


@pytest.mark.parametrize("prompt", [[5, -1], [5, VOCAB], [5, 2**32], [5, 2**40], [-(2**40), 5], [[5, 6], [VOCAB]]])
def test_ids_outside_the_vocabulary_are_refused_naming_the_prompt(prompt):
    assert refusal(prompt) == (OUT_OF_VOCAB, "prompt", None)


@pytest.mark.parametrize("prompt", [[1, "a"], [1, [2]], [-1, "a"], [2**40, [1]], [1, 2, "3"]])
def test_a_list_mixing_ids_with_other_things_is_the_wrong_shape(prompt):
    """[-1, "a"]: the id that cannot be packed comes first; the string still decides the answer."""
    assert refusal(prompt) == (PROMPT_SHAPES, "prompt", None)


def test_the_length_is_checked_before_the_vocabulary():
    message, param, code = refusal([1] * (MAX_MODEL_LEN - 1) + [-1])
    assert (param, code) == ("prompt", "context_length_exceeded")
    assert message.startswith(f"This model's maximum context length is {MAX_MODEL_LEN} tokens.")


def test_empty_prompts_are_refused():
    assert refusal([]) == ("prompt must not be empty", "prompt", None)
    assert refusal([[]]) == ("the prompt is empty", "prompt", None)
    assert refusal([[1], []]) == ("the prompt is empty", "prompt", None)


@pytest.mark.parametrize("ids, keep, kept", [
    ([10, 11, 12, 13, 14], 2, [13, 14]),
    ([10, 11, 12], 5, [10, 11, 12]),  # more than there are: all of them
    ([10, 11, 12], -1, [10, 11, 12]),  # the context length
    ([VOCAB, -1, 2**40, 12, 13], 2, [12, 13]),  # the ids cut off are never checked, whatever they are
])
def test_truncation_keeps_the_last_ids_packed_alike(ids, keep, kept):
    [prompt] = completion(ids, truncate_prompt_tokens=keep).prompts
    assert list(prompt.token_ids) == kept
    assert prompt.packed == pack_token_ids(kept)


def test_truncation_leaves_an_id_outside_the_vocabulary_in_what_it_keeps_refused():
    assert refusal([1, 2, VOCAB], truncate_prompt_tokens=2) == (OUT_OF_VOCAB, "prompt", None)
