"""How many choices one request may ask for: `--max-n`, never above the worker's max_num_seqs,
refused with a 400 in OpenAI's shape naming `n`; and the choices of one request sent to the
worker as one client request (`Generate.parent_id`)."""

from __future__ import annotations

import httpx
import pytest
from fake_worker import FakeWorkerProcess
from server_helpers import MODEL, server_in_thread

from spillway.gateway.http.app import ServerSettings, build_app
from spillway.gateway.generation.jobs import Job, Prompt
from spillway.gateway.api.sampling_params import SamplingParams
from spillway.gateway.generation.serving import Generation
from spillway.protocol.config import WorkerConfig

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Say it."}], "max_tokens": 2}


def app_over_fake_worker(files, max_num_seqs: int, **settings):
    config = WorkerConfig(model=str(files.path), served_model_name=MODEL, max_model_len=256,
                          max_num_seqs=max_num_seqs)
    return build_app(ServerSettings(worker=config, served_model_names=[MODEL], **settings),
                     lambda: FakeWorkerProcess(config, [11, 12, 13], step_s=0.002))


def refusal(url: str, path: str, body: dict) -> dict:
    answer = httpx.post(url + path, json=body, timeout=30)
    assert answer.status_code == 400, answer.text
    return answer.json()["error"]


@pytest.mark.parametrize("max_num_seqs, settings, limit", [(256, {"max_n": 4}, 4), (3, {}, 3)],
                         ids=["max_n", "max_num_seqs"])
def test_n_above_the_limit_gets_a_400_naming_n_and_the_limit(files, max_num_seqs, settings, limit):
    with server_in_thread(app_over_fake_worker(files, max_num_seqs, **settings)) as url:
        error = refusal(url, "/v1/chat/completions", {**CHAT, "n": limit + 1})
        assert (error["param"], error["type"], error["code"]) == ("n", "invalid_request_error",
                                                                  "integer_above_max_value")
        assert error["message"].startswith(f"n={limit + 1} exceeds this server's limit of {limit} choices per request")
        completion = {"model": MODEL, "prompt": "Say it.", "max_tokens": 2, "n": limit + 1}
        assert refusal(url, "/v1/completions", completion)["param"] == "n"
        answer = httpx.post(url + "/v1/chat/completions", json={**CHAT, "n": limit}, timeout=30)
        assert answer.status_code == 200 and len(answer.json()["choices"]) == limit


class _Client:
    def submit(self, generates, num_samples: int = 1):
        self.generates = generates


def test_every_choice_of_every_prompt_names_its_request_as_parent():
    job = Job(request_id="cmpl-7", chat=False, model="m", prompts=[Prompt([1, 2, 3]), Prompt([4, 5])],
              params=SamplingParams(n=2), max_tokens=[4, 4])
    client = _Client()
    Generation(job, client, None, lambda ids, salt: []).start()
    assert [(g.request_id, g.parent_id) for g in client.generates] == [
        ("cmpl-7-0-0", "cmpl-7"), ("cmpl-7-0-1", "cmpl-7"), ("cmpl-7-1-0", "cmpl-7"), ("cmpl-7-1-1", "cmpl-7")]
