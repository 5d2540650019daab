"""tools/bench/serve/serve.py: its SSE timing parser on canned events, its command-line pieces, and one
end-to-end run on the CPU (smollm2-135m shape, dummy weights, a few requests of a few tokens);
server_process.py's process bookkeeping (grandchildren, the parent-death signal)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(ROOT))

from spillway.tools.bench.serve import serve  # noqa: E402
from spillway.tools.bench.serve.server_process import TOKENIZER_FILES, build_model_folder, cpu_seconds, descendants, wait_gone  # noqa: E402
from spillway.tools.bench.serve.stream_client import StreamError, StreamTiming, completion_body, split_events, stream_completion  # noqa: E402


def chunk(text: str, completion: int | None, prompt: int = 7, cached: int = 0, finish: str | None = None) -> str:
    event = {"id": "cmpl-1", "object": "text_completion", "choices": [
        {"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": None}]}
    if completion is not None:
        event["usage"] = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                          "prompt_tokens_details": {"cached_tokens": cached}}
    return json.dumps(event)


def usage_only(completion: int, prompt: int = 7, cached: int = 0) -> str:
    return json.dumps({"id": "cmpl-1", "choices": [], "usage": {
        "prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached}}})


def test_continuous_usage_gives_each_event_its_token_count_and_gaps():
    timing = StreamTiming(start=10.0)
    timing.feed(10.5, chunk("a", 1, cached=4))
    timing.feed(10.6, chunk("bc", 3, cached=4))  # two tokens in one event
    timing.feed(10.9, chunk("d", 4, cached=4))
    timing.feed(11.0, chunk("", 5, cached=4, finish="length"))  # a held-back token arrives with the finish
    timing.feed(11.0, usage_only(5, cached=4))
    timing.feed(11.0, "[DONE]")
    timing.check(5)
    assert timing.ttft == 0.5
    assert timing.event_tokens == [1, 2, 1, 1]
    assert [round(g, 6) for g in timing.gaps] == [0.1, 0.3, 0.1]
    assert (timing.prompt_tokens, timing.completion_tokens, timing.cached_tokens) == (7, 5, 4)
    assert timing.tokens_exact


def test_usage_at_the_end_only_counts_one_token_per_text_event():
    timing = StreamTiming(start=0.0)
    timing.feed(0.25, chunk("a", None))
    timing.feed(0.5, chunk("", None))  # no text, no usage: carries nothing countable
    timing.feed(0.75, chunk("b", None))
    timing.feed(1.0, usage_only(3))
    timing.feed(1.0, "[DONE]")
    timing.check(3)  # the events' count cannot be checked against usage here
    assert (timing.ttft, timing.gaps, timing.event_tokens, timing.tokens_exact) == (0.25, [0.5], [1, 1], False)


@pytest.mark.parametrize(("events", "expected", "message"), [
    ([chunk("a", 1)], 1, "without \\[DONE\\]"),
    ([chunk("a", 1), usage_only(1), "[DONE]"], 2, "usage reports 1 completion tokens, not 2"),
])
def test_check_refuses_an_incomplete_stream(events, expected, message):
    timing = StreamTiming(start=0.0)
    for event in events:
        timing.feed(1.0, event)
    with pytest.raises(StreamError, match=message):
        timing.check(expected)


@pytest.mark.parametrize(("payload", "message"), [
    ('{"error": {"message": "worker lost", "code": 503}}', "error event"),
    ("not json", "not JSON"),
    ("[1, 2]", "not a JSON object"),
])
def test_bad_events_raise(payload, message):
    with pytest.raises(StreamError, match=message):
        StreamTiming(start=0.0).feed(1.0, payload)


def test_an_event_after_done_raises():
    timing = StreamTiming(start=0.0)
    timing.feed(1.0, "[DONE]")
    with pytest.raises(StreamError, match="after \\[DONE\\]"):
        timing.feed(1.0, chunk("a", 1))


def test_split_events_keeps_the_incomplete_tail():
    payloads, rest = split_events(b'data: {"a": 1}\n\ndata: [DONE]\r\n\r\ndata: {"b"')
    assert (payloads, rest) == (['{"a": 1}', "[DONE]"], b'data: {"b"')
    payloads, rest = split_events(rest + b": 2}\n\n")
    assert (payloads, rest) == (['{"b": 2}'], b"")


def test_completion_body_asks_for_exact_lengths_and_usage_on_every_chunk():
    assert completion_body([5, 6], 3, "bench") == {
        "model": "bench", "prompt": [5, 6], "max_tokens": 3, "temperature": 0.0, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}}


def serve_once(status: bytes, pieces: list[bytes], received: list[bytes]):
    """A one-shot HTTP server answering with `pieces` as chunks; the request bodies go to `received`."""
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        received.append(await reader.readexactly(length))
        writer.write(b"HTTP/1.1 " + status + b"\r\ntransfer-encoding: chunked\r\n\r\n")
        for piece in pieces:
            writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        writer.close()

    return asyncio.start_server(handle, "127.0.0.1", 0)


def test_the_client_reads_events_split_anywhere_across_chunks():
    raw = "".join(f"data: {e}\n\n" for e in [chunk("a", 1), chunk("bc", 3), usage_only(3), "[DONE]"]).encode()
    received: list[bytes] = []

    async def run() -> StreamTiming:
        server = await serve_once(b"200 OK", [raw[:7], raw[7:150], raw[150:]], received)
        async with server:
            return await stream_completion(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", [5, 6], 3, "m")

    timing = asyncio.run(run())
    assert timing.done and timing.event_tokens == [1, 2] and timing.completion_tokens == 3
    assert json.loads(received[0]) == completion_body([5, 6], 3, "m")


@pytest.mark.parametrize("preconnect", [False, True])
def test_a_preconnected_burst_opens_every_connection_before_its_first_clock_starts(monkeypatch, preconnect):
    from spillway.tools.bench.serve import stream_client

    raw = "".join(f"data: {e}\n\n" for e in [chunk("a", 1), "[DONE]"]).encode()
    received: list[bytes] = []
    opened: list[float] = []
    open_connection = stream_client.open_connection

    async def traced(url):
        opened.append(time.perf_counter())
        return await open_connection(url)

    monkeypatch.setattr(stream_client, "open_connection", traced)

    async def run():
        server = await serve_once(b"200 OK", [raw], received)
        async with server:
            url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
            return await stream_client.stream_all(url, [[5, 6]] * 8, 1, "m", preconnect=preconnect)

    timings, _ = asyncio.run(run())
    assert len(received) == len(opened) == 8 and all(t.done and t.completion_tokens == 1 for t in timings)
    first_clock = min(t.start for t in timings)
    assert (max(opened) < first_clock) == preconnect  # else each request's clock runs through its connect


def test_the_client_raises_on_an_error_status():
    async def run() -> None:
        server = await serve_once(b"429 Too Many Requests", [b'{"error": {}}'], [])
        async with server:
            await stream_completion(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", [5], 3, "m")

    with pytest.raises(StreamError, match="HTTP 429"):
        asyncio.run(run())


def test_percentile_interpolates_between_ranks():
    values = [4.0, 1.0, 3.0, 2.0]
    assert [serve.percentile(values, q) for q in (0, 50, 90, 100)] == pytest.approx([1.0, 2.5, 3.7, 4.0])
    assert math.isnan(serve.percentile([], 50))


def test_rows_by_name_or_number():
    assert serve.parse_rows("5,ttft,3") == ["ttft", "itl", "small"]
    with pytest.raises(Exception, match="unknown row '6'"):
        serve.parse_rows("6")


def test_engine_flags_reach_serve_and_llm_alike():
    args = serve.build_parser().parse_args(
        ["--kv-cache-dtype", "fp8", "--max-num-seqs", "512", "--enforce-eager", "--no-async-scheduling"])
    settings = serve.engine_settings(args)
    assert settings == {"kv_cache_dtype": "fp8", "max_num_seqs": 512, "enforce_eager": True,
                        "async_scheduling": False}
    assert serve.serve_flags(settings) == ["--kv-cache-dtype", "fp8", "--max-num-seqs", "512",
                                                 "--enforce-eager", "--no-async-scheduling"]


def test_the_cpu_kv_tier_flag_reaches_serve_and_llm_alike():
    settings = serve.engine_settings(serve.build_parser().parse_args(["--cpu-offload-gb", "40"]))
    assert settings == {"cpu_offload_gb": 40.0}
    assert serve.serve_flags(settings) == ["--cpu-offload-gb", "40.0"]


def test_model_folder_has_the_config_with_the_tokenizer_vocabulary(tmp_path):
    tokenizer = tmp_path / "tok"
    tokenizer.mkdir()
    for name in TOKENIZER_FILES:
        (tokenizer / name).write_text(name)
    folder = build_model_folder("qwen3-32b", tokenizer, tmp_path / "models")
    config = json.loads((folder / "config.json").read_text())
    assert (config["vocab_size"], config["bos_token_id"], config["eos_token_id"]) == (49152, 1, 2)
    assert (config["hidden_size"], config["num_hidden_layers"], config["intermediate_size"]) == (5120, 64, 25600)
    assert sorted(p.name for p in folder.iterdir()) == sorted(["config.json", *TOKENIZER_FILES])
    assert (folder / "tokenizer.json").read_text() == "tokenizer.json"
    with pytest.raises(ValueError, match="no built-in config 'qwen9'"):
        build_model_folder("qwen9", tokenizer, tmp_path / "models")


def test_cpu_seconds_of_this_process_grow():
    before = cpu_seconds(os.getpid())
    sum(i * i for i in range(300_000))
    assert cpu_seconds(os.getpid()) > before


def test_stop_waits_for_the_grandchildren():
    parent = subprocess.Popen(["sh", "-c", "sleep 30 & sleep 30 & wait"])
    try:
        deadline = time.monotonic() + 10
        while len(children := descendants(parent.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(children) == 2
        with pytest.raises(TimeoutError, match="still run"):
            wait_gone(children, 0.2)
        for child in children:
            os.kill(child, signal.SIGKILL)
        wait_gone(children, 10)
    finally:
        parent.kill()
        parent.wait()


def test_a_child_with_the_parent_death_signal_dies_with_its_starter_killed_outright():
    starter = textwrap.dedent("""
        import subprocess, sys, time
        from spillway.tools.bench.serve.server_process import parent_death_signal
        for armed in (True, False):
            child = subprocess.Popen(["sleep", "60"], start_new_session=True,
                                     preexec_fn=parent_death_signal() if armed else None)
            print(child.pid, flush=True)
        time.sleep(60)
    """)
    process = subprocess.Popen([sys.executable, "-c", starter], stdout=subprocess.PIPE, text=True)
    armed, unarmed = (int(process.stdout.readline()) for _ in range(2))
    try:
        process.kill()  # no clean-up of its own can run
        process.wait(10)
        wait_gone([armed], 10)
        with open(f"/proc/{unarmed}/stat") as stat:  # the one started without it still runs
            assert stat.read().rsplit(")", 1)[1].split()[0] in "RS"
    finally:
        for pid in (armed, unarmed):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_export_tokenizer_writes_the_files(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "bench" / "serve" / "serve.py"), "--export-tokenizer",
                           str(tmp_path / "tok")], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in (tmp_path / "tok").iterdir()) == sorted(TOKENIZER_FILES)
    assert json.loads((tmp_path / "tok" / "tokenizer.json").read_text())["model"]["type"] == "BPE"


def test_end_to_end_on_the_cpu_prints_every_row_with_finite_figures(tmp_path):
    results = tmp_path / "rows.jsonl"
    command = [sys.executable, str(ROOT / "tools" / "bench" / "serve" / "serve.py"), "--model", "smollm2-135m",
               "--repeats", "2", "--short-prompt-len", "16", "--long-prompt-len", "32", "--warm-new-tokens", "16",
               "--itl-tokens", "4", "--itl-streams", "1", "--num-requests", "3", "--input-len", "16",
               "--output-len", "4", "--small-num-requests", "2", "--small-input-len", "8", "--small-output-len", "4",
               "--max-model-len", "128", "--results", str(results)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    assert [r["name"] for r in rows] == [
        "smollm2-135m TTFT idle, 16-token prompt", "smollm2-135m TTFT 32 cold", "smollm2-135m TTFT 32 cached + 16",
        "smollm2-135m TTFT 32 cold, caching on", "smollm2-135m ITL one stream, 4 tokens",
        "smollm2-135m throughput 3 x (16/4)", "smollm2-135m throughput 2 x (8/4)"]
    for r in rows:
        assert all(math.isfinite(r[k]) and r[k] > 0 for k in ("value", "baseline", "ratio")), r
        assert r["name"] in done.stdout
    # The cached request hit the whole 32-token prefix on both sides; the cold ones hit nothing.
    assert "cached tokens [0]" in rows[1]["note"]
    assert "cached tokens served [32], offline [32]" in rows[2]["note"]
    assert rows[5]["unit"] == "output tok/s" and "gateway CPU" in rows[5]["note"]


def test_qwen3_32b_is_a_builtin_name_the_engine_builds():
    """tools/bench/engine/engine.py's `--decode qwen3-32b` resolves the name as every built-in config."""
    from spillway.protocol.local.model_files import builtin_config_names, load_config, resolve_model
    from spillway.worker.models.spec import DecoderSpec

    assert "qwen3-32b" in builtin_config_names()
    spec = DecoderSpec.from_config(load_config(resolve_model("qwen3-32b", load_format="dummy")))
    assert (spec.hidden_size, spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim,
            spec.intermediate_size, spec.vocab_size, spec.rope_theta, spec.rms_norm_eps, spec.tie_word_embeddings,
            spec.qk_norm) == (5120, 64, 64, 8, 128, 25600, 151936, 1e6, 1e-6, False, True)


def test_a_burst_is_encoded_before_any_request_is_sent(monkeypatch):
    """Encoding as each request starts would hold every send behind all the encodings while
    the first requests' clocks run: a burst's TTFTs would count the client's JSON work."""
    import asyncio

    from spillway.tools.bench.serve import stream_client

    events = []
    encode = stream_client.encode_body
    monkeypatch.setattr(stream_client, "encode_body", lambda *a: (events.append("encode"), encode(*a))[1])

    async def refuse(url, method, path, body=None, connection=None):
        events.append("send")
        raise ValueError("no server here")

    monkeypatch.setattr(stream_client, "send_request", refuse)
    with pytest.raises(StreamError):
        asyncio.run(stream_client.stream_all("http://127.0.0.1:9", [[5] * 10] * 3, 1, "m"))
    assert events[:3] == ["encode"] * 3 and "send" in events
