"""`--generation-config`, `--max-logprobs` and `--tokenizer`: what requests get for the fields
they leave out, the limit on logprobs (400 above it), and a tokenizer from another folder."""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest

from spillway.gateway.api import openai as api
from spillway.gateway.http.app import ServerSettings, load_tokenizer
from spillway.gateway.generation.jobs import JobBuilder
from spillway.gateway.api.request_defaults import RequestDefaults, read_request_defaults
from spillway.gateway.text.tokenizer import PromptTokenizer
from spillway.protocol.local import model_files
from spillway.protocol.config import WorkerConfig
from spillway.protocol.messages import PROTOCOL_VERSION, Ready

READY = Ready(protocol_version=PROTOCOL_VERSION, model="m", block_size=16, hash_seed=b"", num_gpu_blocks=64,
              num_cpu_blocks=0, max_model_len=256, max_num_seqs=8, max_num_batched_tokens=256, vocab_size=49152,
              eos_token_ids=[2], device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def tokenizer(files):
    return PromptTokenizer(model_files.load_tokenizer(files))


def build(tokenizer, defaults: RequestDefaults) -> JobBuilder:
    return JobBuilder(tokenizer, ["m"], lambda: READY, defaults=defaults)


def chat(builder: JobBuilder, **fields):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return asyncio.run(builder.chat_job(api.decode_request(json.dumps(body).encode(), api.ChatCompletionRequest)))


def completion(builder: JobBuilder, **fields):
    body = {"model": "m", "prompt": "hi", **fields}
    return asyncio.run(builder.completion_job(api.decode_request(json.dumps(body).encode(), api.CompletionRequest)))


def write_generation_config(folder, **values):
    folder.mkdir(exist_ok=True)
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, **values}))
    return folder


def test_a_generation_config_folder_gives_the_defaults_vllm_takes(tmp_path):
    folder = write_generation_config(tmp_path / "g", temperature=0.6, top_p=0.9, top_k=20, repetition_penalty=1.1,
                                     max_new_tokens=7, do_sample=True)
    defaults = read_request_defaults(str(folder), tmp_path / "model")
    assert defaults == RequestDefaults(temperature=0.6, top_p=0.9, top_k=20, repetition_penalty=1.1, max_tokens=7)


def test_auto_reads_the_models_own_file_and_vllm_none(tmp_path):
    model = write_generation_config(tmp_path / "model", temperature=0.3)
    assert read_request_defaults("auto", model).temperature == 0.3
    assert read_request_defaults("vllm", model) == RequestDefaults()
    assert read_request_defaults("auto", tmp_path / "no-file-here") == RequestDefaults()


@pytest.mark.parametrize("values, named", [({"temperature": "hot"}, "temperature"), ({"top_k": 2.5}, "top_k")])
def test_bad_generation_configs_are_refused_naming_the_key(tmp_path, values, named):
    folder = write_generation_config(tmp_path / "g", **values)
    with pytest.raises(ValueError, match=named):
        read_request_defaults(str(folder), tmp_path)
    with pytest.raises(ValueError, match="--generation-config"):
        read_request_defaults(str(tmp_path / "missing"), tmp_path)


def test_defaults_fill_only_what_the_request_leaves_out(tokenizer):
    builder = build(tokenizer, RequestDefaults(temperature=0.6, top_k=20, max_tokens=7))
    job = chat(builder)
    assert (job.params.temperature, job.params.top_k, job.max_tokens) == (0.6, 20, [7])
    job = chat(builder, temperature=0.0, top_k=5, max_tokens=3)
    assert (job.params.temperature, job.params.top_k, job.max_tokens) == (0.0, 5, [3])
    assert completion(builder).max_tokens == [7]
    assert completion(build(tokenizer, RequestDefaults())).max_tokens == [16]  # the API's own default
    assert chat(build(tokenizer, RequestDefaults(max_tokens=10_000))).max_tokens[0] < 256  # capped by the room


def test_logprobs_above_max_logprobs_are_a_400_naming_the_field(tokenizer):
    builder = build(tokenizer, RequestDefaults(max_logprobs=2))
    assert chat(builder, logprobs=True, top_logprobs=2).params.logprobs == 2
    with pytest.raises(api.ApiError) as error:
        chat(builder, logprobs=True, top_logprobs=3)
    assert error.value.status == 400 and error.value.param == "top_logprobs" and "--max-logprobs" in str(error.value)
    with pytest.raises(api.ApiError) as error:
        completion(builder, logprobs=3)
    assert error.value.status == 400 and error.value.param == "logprobs"


def test_the_tokenizer_comes_from_the_folder_given(tmp_path, files):
    folder = tmp_path / "tokenizer"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(files.path / name, folder / name)
    settings = ServerSettings(worker=WorkerConfig(model=str(files.path)), tokenizer=str(folder))
    assert load_tokenizer(settings).name_or_path == str(folder)
