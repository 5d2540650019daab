"""tools/bench/serve/stream_client.py's burst split over client processes: every stream answered, in the
prompts' order, all sent at one start time."""

from __future__ import annotations

import asyncio
import json
import sys
import threading
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))

from spillway.tools.bench.serve.stream_client import StreamError, stream_all_processes  # noqa: E402


def usage_chunk(prompt_tokens: int) -> bytes:
    event = {"choices": [{"index": 0, "text": "a", "finish_reason": "length"}],
             "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": 1, "total_tokens": prompt_tokens + 1}}
    return f"data: {json.dumps(event)}\n\ndata: [DONE]\n\n".encode()


class Server:
    """An HTTP server on its own thread answering each completion with one token, its usage
    counting the prompt's ids; the bodies go to `received`."""

    def __init__(self) -> None:
        self.received: list[dict] = []
        self._loop = asyncio.new_event_loop()
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self._thread.start()
        ready.wait(10)

    def _run(self, ready: threading.Event) -> None:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            body = json.loads(await reader.readexactly(length))
            self.received.append(body)
            piece = usage_chunk(len(body["prompt"]))
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(piece), piece))
            await writer.drain()
            writer.close()

        async def main() -> None:
            server = await asyncio.start_server(handle, "127.0.0.1", 0)
            self.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
            ready.set()
            async with server:
                await server.serve_forever()

        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(main())
        except RuntimeError:
            pass  # stopped

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)


@pytest.mark.parametrize("preconnect", [False, True])
def test_a_burst_over_three_processes_answers_every_prompt_in_order(preconnect):
    server = Server()
    try:
        prompts = [[7] * (n + 1) for n in range(7)]  # each prompt's length names it
        timings = stream_all_processes(server.url, prompts, 1, "m", 3, preconnect=preconnect)
    finally:
        server.stop()
    assert [t.prompt_tokens for t in timings] == [1, 2, 3, 4, 5, 6, 7]
    assert all(t.done and t.completion_tokens == 1 and t.ttft is not None for t in timings)
    assert sorted(len(body["prompt"]) for body in server.received) == [1, 2, 3, 4, 5, 6, 7]
    # One start time for all three processes: the first clocks start within a few ms of each other.
    firsts = [min(t.start for t in timings[i::3]) for i in range(3)]
    assert max(firsts) - min(firsts) < 0.05


def test_a_client_process_that_cannot_connect_is_reported():
    with pytest.raises(StreamError, match="a client process failed"):
        stream_all_processes("http://127.0.0.1:9", [[1], [2]], 1, "m", 2, preconnect=True, timeout=30)
    with pytest.raises(ValueError, match="at least one process"):
        stream_all_processes("http://127.0.0.1:9", [[1]], 1, "m", 0)
