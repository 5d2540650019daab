"""How API server processes sharing one socket (`spillway serve --api-server-count N`) divide
connections among themselves: N uvicorn servers of gateway/http/shared_accept.py, each answering a
request with its process id after 1 ms of CPU (a long prompt's intake), with the servers'
counts of open connections (this tree) and without them (each takes one connection per turn,
then pauses 1 ms), side by side, the rounds alternating.

    python tools/bench/serve/accept.py                      # 4 servers, 40 connections, 0/2/5 ms apart
    python tools/bench/serve/accept.py --busy-loops 2       # beside two processes that spin (a loaded host)

Rows: `pool, G ms apart`: the connections made G ms apart (the client blocking between them),
then one request on each at once, as a pool opened slowly and used in a burst: how many each
server took (sorted, per round). `plain burst`: each request opens its own connection at once
and closes it with its answer: the median request's time and the burst's, medians over rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import importlib.util
import multiprocessing
import os
import socket
import statistics
import sys
import time


REQUEST = b"POST / HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: 2\r\n\r\n{}"


async def answer_with_pid(scope, receive, send) -> None:
    while (await receive()).get("more_body"):
        pass
    begin = time.perf_counter()
    while time.perf_counter() - begin < 0.001:  # an intake's CPU
        pass
    body = str(os.getpid()).encode()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(body))]})
    await send({"type": "http.response.body", "body": body})


def serve(sock: socket.socket, slot=None) -> None:
    """One API server on `sock` answering with its process id; `slot`: its connection count."""
    import uvicorn

    from spillway.gateway.http.shared_accept import SharedSocketServer

    loop = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    config = uvicorn.Config(answer_with_pid, loop=loop, lifespan="off", log_level="warning")
    SharedSocketServer(config, slot=slot).run(sockets=[sock])


async def ask(reader, writer) -> int:
    writer.write(REQUEST)
    reply = await reader.read()
    writer.close()
    return int(reply.rsplit(b"\r\n\r\n", 1)[1])


async def pool(port: int, count: int, gap_s: float) -> list[int]:
    connections = []
    for _ in range(count):
        connections.append(await asyncio.open_connection("127.0.0.1", port))
        time.sleep(gap_s)  # blocking: every server is looking when the next one comes
    await asyncio.sleep(0.05)
    taken = collections.Counter(await asyncio.gather(*(ask(*connection) for connection in connections)))
    return sorted(taken.values())


async def plain_burst(port: int, count: int) -> tuple[float, float]:
    async def one() -> float:
        start = time.perf_counter()
        await ask(*await asyncio.open_connection("127.0.0.1", port))
        return time.perf_counter() - start

    start = time.perf_counter()
    times = await asyncio.gather(*(one() for _ in range(count)))
    return statistics.median(times) * 1e3, (time.perf_counter() - start) * 1e3


def spin() -> None:
    while True:
        pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--servers", type=int, default=4)
    parser.add_argument("--connections", type=int, default=40)
    parser.add_argument("--gaps-ms", default="0,2,5", help="comma-separated gaps between a pool's connections")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--busy-loops", type=int, default=0, help="processes spinning beside the servers")
    args = parser.parse_args(argv)
    if min(args.servers, args.connections, args.rounds) < 1 or args.busy_loops < 0:
        parser.error("--servers, --connections and --rounds must be at least 1, --busy-loops at least 0")
    gaps = [float(gap) for gap in args.gaps_ms.split(",") if gap.strip()]

    from spillway.gateway.http.shared_accept import OpenConnections

    context = multiprocessing.get_context("fork")
    processes, setups = [], {}
    for label, counted in (("counts", True), ("no counts", False)):
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        connections = OpenConnections(args.servers)
        servers = [context.Process(target=serve, args=(sock, connections.slot(index) if counted else None),
                                   daemon=True) for index in range(args.servers)]
        processes += servers
        setups[label] = sock.getsockname()[1]
    processes += [context.Process(target=spin, daemon=True) for _ in range(args.busy_loops)]
    for process in processes:
        process.start()
    try:
        time.sleep(2)  # every server listening
        rows: dict[str, dict[str, list]] = collections.defaultdict(lambda: collections.defaultdict(list))
        for _ in range(args.rounds):
            for label, port in setups.items():
                for gap in gaps:
                    rows[f"pool, {gap:g} ms apart"][label].append(asyncio.run(pool(port, args.connections, gap / 1e3)))
                rows["plain burst"][label].append(asyncio.run(plain_burst(port, args.connections)))
    finally:
        for process in processes:
            process.terminate()
    print(f"{args.servers} API servers, {args.connections} connections, {args.rounds} rounds, "
          f"{args.busy_loops} busy loops, {os.cpu_count()} CPUs")
    for name, results in rows.items():
        for label, runs in results.items():
            if name == "plain burst":
                median = statistics.median(run[0] for run in runs)
                span = statistics.median(run[1] for run in runs)
                figure = f"median request {median:.1f} ms, whole burst {span:.1f} ms"
            else:
                figure = "taken per server " + " ".join(str(run) for run in runs)
            print(f"{name:>22}  {label:>9}  {figure}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
