"""tools/loadgen against a fake OpenAI server with injected delays and failures.

The fake server is a raw asyncio HTTP/1.1 server in a thread of its own. The n-th request it
receives waits `ttfts_s[n % len]` before its first token and `itls_s[k % len]` before token
k + 1, so the loadgen's percentiles can be checked against the delays it was given.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root holds `tools`

from spillway.tools.loadgen.cli import main  # noqa: E402
from spillway.tools.loadgen.report import percentile  # noqa: E402


class FakeServer:
    """Streams `max_tokens` tokens (` t0 t1 ...`) per request; `behaviour(n)` picks failures.

    Behaviours: ok, http_400, http_503, cut (connection dropped after 2 tokens), no_done (the
    stream ends cleanly without `[DONE]`), error_event (an SSE error after 1 token), garbage
    (an event of the wrong shape after 1 token).
    """

    def __init__(self, ttfts_s=(0.01,), itls_s=(0.005,), behaviour=lambda n: "ok", send_usage=True) -> None:
        self.ttfts_s, self.itls_s, self.behaviour = list(ttfts_s), list(itls_s), behaviour
        self.send_usage = send_usage
        self.requests: list[tuple[str, dict]] = []  # (path, body) in arrival order
        self.in_flight = 0
        self.counters = {"prefix_cache_queries": 1000, "prefix_cache_hits": 100, "num_preemptions": 7,
                         "prompt_tokens": 1000, "generation_tokens": 500}
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def __enter__(self) -> FakeServer:
        self.thread.start()
        server = asyncio.run_coroutine_threadsafe(asyncio.start_server(self._connection, "127.0.0.1", 0),
                                                  self.loop).result(10)
        self.server = server
        self.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        return self

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self._shutdown(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()

    async def _shutdown(self) -> None:
        self.server.close()
        handlers = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in handlers:
            task.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = (await reader.readuntil(b"\r\n\r\n")).decode()
                method, path, _ = head.split("\r\n", 1)[0].split(" ")
                headers = {k.strip().lower(): v.strip() for k, v in
                           (line.split(":", 1) for line in head.split("\r\n")[1:] if ":" in line)}
                raw = await reader.readexactly(int(headers.get("content-length", 0)))
                if not await self._route(method, path, raw, writer):
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def _route(self, method: str, path: str, raw: bytes, writer) -> bool:
        if path == "/v1/models":
            return await self._json(writer, 200, {"data": [{"id": "fake-model"}]})
        if path == "/tokenize":
            words = json.loads(raw)["prompt"].split()
            return await self._json(writer, 200, {"count": len(words), "tokens": list(range(len(words)))})
        if path == "/metrics":
            return await self._text(writer, self._metrics())
        if path in ("/v1/completions", "/v1/chat/completions"):
            return await self._generate(path, json.loads(raw), writer)
        return await self._json(writer, 404, {"error": {"message": "no such route"}})

    async def _json(self, writer, status: int, body: dict) -> bool:
        data = json.dumps(body).encode()
        writer.write(f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
                     .encode() + data)
        await writer.drain()
        return True

    async def _text(self, writer, text: str) -> bool:
        data = text.encode()
        writer.write(f"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: {len(data)}\r\n\r\n".encode()
                     + data)
        await writer.drain()
        return True

    def _metrics(self) -> str:
        lines = [f'vllm:{name}_total{{model_name="fake-model"}} {value}' for name, value in self.counters.items()]
        usage = 0.1 * self.in_flight
        lines += [f'vllm:kv_cache_usage_perc{{model_name="fake-model"}} {usage}',
                  f'vllm:gpu_cache_usage_perc{{model_name="fake-model"}} {usage}',
                  f'vllm:cpu_cache_usage_perc{{model_name="fake-model"}} {usage / 2}',
                  f'vllm:num_requests_running{{model_name="fake-model"}} {self.in_flight}']
        return "# HELP vllm:kv_cache_usage_perc usage\n" + "\n".join(lines) + "\n"

    async def _generate(self, path: str, body: dict, writer) -> bool:
        n = len(self.requests)
        self.requests.append((path, body))
        kind = self.behaviour(n)
        if kind.startswith("http_"):
            return await self._json(writer, int(kind[5:]), {"error": {"message": f"injected {kind}"}})
        chat = path.endswith("chat/completions")
        prompt = body["messages"][-1]["content"] if chat else body["prompt"]
        prompt_tokens = len(prompt) if isinstance(prompt, list) else len(prompt.split())
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")

        async def event(payload) -> None:
            data = b"data: " + (payload if isinstance(payload, bytes) else json.dumps(payload).encode()) + b"\n\n"
            writer.write(b"%x\r\n%s\r\n" % (len(data), data))
            await writer.drain()

        self.in_flight += 1
        try:
            self.counters["prefix_cache_queries"] += prompt_tokens
            self.counters["prefix_cache_hits"] += prompt_tokens // 4
            self.counters["prompt_tokens"] += prompt_tokens
            if chat:
                await event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
            await asyncio.sleep(self.ttfts_s[n % len(self.ttfts_s)])
            thinking = body.get("thinking_budget") or 0
            for k in range(body["max_tokens"]):
                if k:
                    await asyncio.sleep(self.itls_s[(k - 1) % len(self.itls_s)])
                if kind == "cut" and k == 2:
                    writer.transport.abort()
                    return False
                if kind == "garbage" and k == 1:
                    await event({"choices": "not a list of choices"})
                    break
                if kind == "error_event" and k == 1:
                    await event({"error": {"message": "injected error event", "type": "server_error"}})
                    break
                text = f" t{k}"
                delta = {"reasoning_content": text} if k < thinking else {"content": text}
                await event({"choices": [{"index": 0, "delta": delta}]} if chat else
                            {"choices": [{"index": 0, "text": text}]})
                self.counters["generation_tokens"] += 1
            else:
                finish = {"index": 0, "finish_reason": "length", **({"delta": {}} if chat else {"text": ""})}
                await event({"choices": [finish]})
                usage = {"prompt_tokens": prompt_tokens, "completion_tokens": body["max_tokens"],
                         "total_tokens": prompt_tokens + body["max_tokens"],
                         "prompt_tokens_details": {"cached_tokens": prompt_tokens // 4},
                         "completion_tokens_details": {"reasoning_tokens": min(thinking, body["max_tokens"])}}
                if self.send_usage and (body.get("stream_options") or {}).get("include_usage"):
                    await event({"choices": [], "usage": usage})
            if kind != "no_done":
                await event(b"[DONE]")
            writer.write(b"0\r\n\r\n")
            await writer.drain()
            return True
        finally:
            self.in_flight -= 1


def run_loadgen(capsys, tmp_path: Path, url: str, *args: str) -> tuple[int, dict, str]:
    output = tmp_path / "results.json"
    code = main(["--url", url, "--no-progress", "--output", str(output), *args])
    printed = capsys.readouterr().out
    return code, json.loads(output.read_text()), printed


def within(measured: float, expected: float, tolerance: float = 0.10) -> bool:
    return abs(measured - expected) <= tolerance * expected


# Five delays each, every one as often as the others, so that each reported percentile falls
# inside one delay's cluster, not between two (where a chunk late by a scheduler's tick, which
# also shortens the gap after it, would move it a whole cluster's distance).
TTFTS_S = [0.10, 0.15, 0.20, 0.25, 0.30]
ITLS_S = [0.04, 0.06, 0.08, 0.10, 0.12]


def test_reported_ttft_itl_tpot_e2e_percentiles_match_the_injected_delays(capsys, tmp_path):
    num_requests, num_tokens = 10, 6  # 5 gaps per request: each ITL value once
    with FakeServer(TTFTS_S, ITLS_S) as server:
        code, results, _ = run_loadgen(capsys, tmp_path, server.url, "--num-requests", str(num_requests),
                                       "--concurrency", "4", "--input-len", "16", "--output-len", str(num_tokens))
    assert code == 0
    injected = {
        "ttft_ms": [1000 * TTFTS_S[n % len(TTFTS_S)] for n in range(num_requests)],
        "itl_ms": [1000 * gap for _ in range(num_requests) for gap in ITLS_S],
        "tpot_ms": [1000 * sum(ITLS_S) / len(ITLS_S)] * num_requests,
        "e2e_ms": [1000 * (TTFTS_S[n % len(TTFTS_S)] + sum(ITLS_S)) for n in range(num_requests)],
    }
    summary = results["summary"]
    for key, values in injected.items():
        expected = {"mean": sum(values) / len(values), "median": percentile(values, 50),
                    "p90": percentile(values, 90), "p99": percentile(values, 99)}
        for stat, value in expected.items():
            assert within(summary[key][stat], value), (key, stat, summary[key][stat], value)
    assert summary["itl_ms"]["count"] == num_requests * (num_tokens - 1)


def test_every_request_is_accounted_for_with_the_servers_usage(capsys, tmp_path):
    with FakeServer() as server:
        code, results, printed = run_loadgen(capsys, tmp_path, server.url, "--num-requests", "10", "--concurrency",
                                             "3", "--input-len", "20:40", "--output-len", "3:6", "--seed", "3")
        bodies = [body for _, body in server.requests]
    summary, records = results["summary"], results["requests"]
    assert code == 0 and "10 ok, 0 failed, 10 sent" in printed
    assert [r["index"] for r in records] == list(range(10)) and all(r["ok"] for r in records)
    assert sorted(b["max_tokens"] for b in bodies) == sorted(r["expected_output_tokens"] for r in records)
    for body in bodies:
        assert body["max_tokens"] == body["min_tokens"] and 3 <= body["max_tokens"] <= 6
        assert body["ignore_eos"] is True and body["stream_options"] == {"include_usage": True}
        assert body["model"] == "fake-model" and body["stream"] is True and body["temperature"] == 0.0
    for record in records:
        assert record["usage_reported"] and record["output_tokens"] == record["expected_output_tokens"]
        assert record["num_chunks"] == record["output_tokens"]
        assert record["prompt_tokens"] == record["expected_prompt_tokens"]  # one token per word here
        assert 20 <= record["prompt_tokens"] <= 40
        assert record["ttft_s"] <= record["e2e_s"]
    assert summary["total_output_tokens"] == sum(b["max_tokens"] for b in bodies)
    assert summary["server"]["generation_tokens"] == summary["total_output_tokens"]
    assert summary["server"]["prompt_tokens"] == summary["total_prompt_tokens"]


def test_without_usage_tokens_are_counted_from_the_stream_and_the_summary_says_so(capsys, tmp_path):
    with FakeServer(send_usage=False) as server:
        code, results, printed = run_loadgen(capsys, tmp_path, server.url, "--num-requests", "3",
                                             "--input-len", "12", "--output-len", "5")
    summary = results["summary"]
    assert code == 0 and summary["num_without_usage"] == 3 and "Without usage" in printed
    assert [r["output_tokens"] for r in results["requests"]] == [5, 5, 5]
    assert summary["total_output_tokens"] == 15 and summary["total_prompt_tokens"] == 36


def test_failures_are_counted_by_kind_and_the_run_completes(capsys, tmp_path):
    kinds = ["ok", "http_400", "cut", "error_event", "no_done", "http_503", "garbage"]
    with FakeServer(behaviour=lambda n: kinds[n % len(kinds)]) as server:
        code, results, printed = run_loadgen(capsys, tmp_path, server.url, "--num-requests", "14",
                                             "--concurrency", "1", "--input-len", "8", "--output-len", "4")
    summary = results["summary"]
    assert code == 0
    assert summary["num_requests"] == 14 and summary["num_ok"] == 2 and summary["num_failed"] == 12
    assert summary["errors"] == {"http_4xx": 2, "stream_cut": 4, "stream_error": 2, "http_5xx": 2,
                                 "bad_response": 2}
    assert "injected http_400" in summary["error_examples"]["http_4xx"]
    assert "Errors: stream_cut" in printed
    assert [r["ok"] for r in results["requests"]] == [kind == "ok" for kind in kinds * 2]


def test_a_server_that_is_down_gives_connect_errors_and_exit_status_1(capsys, tmp_path):
    with FakeServer() as server:
        url = server.url  # the port is closed once the server has stopped
    code, results, printed = run_loadgen(capsys, tmp_path, url, "--num-requests", "3", "--input-len", "8",
                                         "--output-len", "2")
    assert code == 1
    assert results["summary"]["errors"] == {"connect": 3}
    assert results["summary"]["server"] is None and "unavailable" in printed


def test_server_metrics_give_hit_rate_cache_peaks_and_preemptions(capsys, tmp_path):
    with FakeServer(ttfts_s=[0.3], itls_s=[0.05]) as server:
        code, results, _ = run_loadgen(capsys, tmp_path, server.url, "--num-requests", "4", "--concurrency", "4",
                                       "--input-len", "40", "--output-len", "3", "--metrics-interval", "0.05")
    server_report = results["summary"]["server"]
    assert code == 0
    assert server_report["prefix_cache_queries"] == 160 and server_report["prefix_cache_hits"] == 40
    assert server_report["prefix_cache_hit_rate"] == pytest.approx(0.25)
    assert server_report["num_preemptions"] == 0
    assert server_report["gpu_cache_usage_peak"] == pytest.approx(0.4)
    assert server_report["cpu_cache_usage_peak"] == pytest.approx(0.2)
    assert server_report["num_running_peak"] == 4
    assert results["summary"]["cached_prompt_fraction"] == pytest.approx(0.25)
