"""The article's command, a role added, on a DeepSeek-V3-shaped model (multi-head latent
attention: its KV block is one latent row a token): prefill and decode workers moving latent
blocks generate what one engine does, and a server started with the article's flags answers the
two-server proxy's steps as a plain server does."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "worker"))
from tiny_models import tiny_deepseek_v3  # noqa: E402

from server_helpers import real_server  # noqa: E402
from spillway import LLM, SamplingParams  # noqa: E402
from spillway.tools.bench.serve.server_process import export_tokenizer  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("prefill_decode_real")]

ARTICLE_MLA = '{"mla_backend":"TOKENSPEED_MLA"}'
GREEDY = {"temperature": 0.0, "max_tokens": 10, "ignore_eos": True}
# Prompts of several whole blocks (16 tokens) and a tail, so the consumer pulls latent blocks.
PROMPTS = [[7, *range(200, 260)], [9, *range(300, 347)], [11, *range(400, 433)]]


@pytest.fixture(scope="module")
def deepseek_v3(tmp_path_factory) -> str:
    """A tiny random DeepSeek-V3 with the default model's vocabulary and tokenizer files."""
    folder = tmp_path_factory.mktemp("deepseek_v3_article")
    tiny_deepseek_v3(vocab_size=49152, eos_token_id=2).save_pretrained(folder)
    export_tokenizer(folder)
    return str(folder)


def test_prefill_and_decode_workers_move_latent_blocks_and_generate_what_one_engine_does(deepseek_v3):
    params = SamplingParams(**GREEDY)
    prompts = [{"prompt_token_ids": ids} for ids in PROMPTS]
    outputs = {}
    for name, arguments in (("one", {}), ("disaggregated", dict(
            prefill_workers=1, decode_workers=1, additional_config={"mla_backend": "TOKENSPEED_MLA"},
            kv_transfer_config={"kv_connector": "PyNcclConnector", "kv_role": "kv_both"}))):
        llm = LLM(deepseek_v3, max_model_len=256, **arguments)
        try:
            outputs[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            stats = llm.stats()
        finally:
            llm.shutdown()
    assert outputs["disaggregated"] == outputs["one"] and all(len(ids) == 10 for ids in outputs["one"])
    # Every prompt's whole blocks but the one holding its last token were pulled, as latent rows.
    assert stats.kv_transfer_bytes_received == stats.kv_transfer_bytes_sent > 0


def complete(url: str, prompt: list[int], **body) -> dict:
    reply = httpx.post(url + "/v1/completions", json={"prompt": prompt, **GREEDY, **body}, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_the_articles_command_with_a_role_serves_the_proxy_steps(deepseek_v3):
    flags = ["--max-model-len", "256", "--additional-config", ARTICLE_MLA]
    role = '{{"kv_connector":"PyNcclConnector","kv_role":"{}"}}'
    with real_server(deepseek_v3, *flags) as plain, \
            real_server(deepseek_v3, *flags, "--kv-transfer-config", role.format("kv_producer")) as prefill, \
            real_server(deepseek_v3, *flags, "--kv-transfer-config", role.format("kv_consumer")) as decode:
        for prompt in PROMPTS:
            first = complete(prefill.url, prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
            params = first["kv_transfer_params"]
            assert params["do_remote_prefill"] is True and params["remote_address"].startswith("ipc://")
            answer = complete(decode.url, prompt, kv_transfer_params=params)
            assert answer["choices"][0]["text"] == complete(plain.url, prompt)["choices"][0]["text"]
        received = [line for line in httpx.get(decode.url + "/metrics", timeout=10).text.splitlines()
                    if line.startswith('vllm:kv_transfer_bytes_total{') and 'direction="received"' in line]
        logs = [server.log() for server in (prefill, decode)]
    assert received and float(received[0].rsplit(" ", 1)[1]) > 0
    for log in logs:  # each worker says which kernel runs for the backend named, and how blocks move
        assert "attention backend TOKENSPEED_MLA requested" in log and "host memory" in log
