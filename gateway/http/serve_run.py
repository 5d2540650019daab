"""The life of a `spillway serve` process: its port taken before anything slow, a banner once
it serves, and a quiet end on Ctrl-C or SIGTERM.

    bind HOST:PORT ──▶ start the worker (model load) ──▶ uvicorn on that socket ──▶ banner
    SIGINT / SIGTERM at any point ──▶ worker closed, exit status 0, no traceback

The socket is bound first, so a port in use ends the command in a moment rather than after
the model has loaded, and no other process can take the port in between. The first worker
starts before the server (`local_workers`) while the tokenizer loads beside it
(`in_background`); with `--api-server-count` the other servers run `serve_api_server`
(gateway/http/api_servers.py forks them).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import signal
import socket
import threading
import time
from concurrent.futures import Future
from contextlib import contextmanager

import uvicorn

from spillway.gateway.http.shared_accept import SharedSocketServer
from spillway.gateway.link.worker_process import WorkerProcess

logger = logging.getLogger("spillway.gateway")


class PortInUse(OSError):
    """The port cannot be bound: another process listens on it, or it is not this host's."""


class Stopped(BaseException):
    """SIGTERM arrived: unwinds like Ctrl-C's KeyboardInterrupt, whatever the process was doing."""


def bind_port(host: str, port: int) -> socket.socket:
    """A socket bound to host:port, for uvicorn to listen on; PortInUse naming both otherwise."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        raise PortInUse(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart need not wait for TIME_WAIT
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise PortInUse(f"cannot listen on {host}:{port}: port {port} is in use or not available "
                        f"({exc.strerror}); choose another with --port") from None
    return sock


class BannerServer(SharedSocketServer):
    """uvicorn's server, which says once it serves where and what. With `api_servers` (the
    other API servers on its port) it takes its connections one at a time, as they do
    (gateway/http/shared_accept.py), and its shutdown waits for theirs before its own, which closes
    the worker they use."""

    def __init__(self, config: uvicorn.Config, model_name: str, api_servers=None) -> None:
        super().__init__(config, shared=api_servers is not None,
                         slot=api_servers.connections.slot(0) if api_servers is not None else None)
        self.model_name = model_name
        self.api_servers = api_servers

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:
            if self.api_servers is not None:
                self.api_servers.now_serving()
            host = f"[{self.config.host}]" if ":" in self.config.host else self.config.host
            count = f" with {self.api_servers.count} API server processes" if self.api_servers is not None else ""
            logger.info("Spillway serves %s at http://%s:%d%s (OpenAI-compatible API under /v1); "
                        "Ctrl-C to stop", self.model_name, host, self.config.port, count)

    async def shutdown(self, sockets=None) -> None:
        if self.api_servers is not None:
            self.api_servers.begin_stop()
            await asyncio.to_thread(self.api_servers.join)
        await super().shutdown(sockets)


@contextmanager
def stop_on_sigterm():
    """SIGTERM raises Stopped, as SIGINT raises KeyboardInterrupt, until the block ends.

    uvicorn handles both while it serves, then raises the signal again once it has shut
    down; this handler turns that second SIGTERM into an ordinary return."""

    def on_sigterm(signum, frame) -> None:
        raise Stopped()

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def in_background(function, *args) -> Future:
    """`function(*args)` in a daemon thread (an exit need not wait for it); its Future."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(function(*args))
        except BaseException as exc:
            future.set_exception(exc)

    threading.Thread(target=run, name=f"spillway-{function.__name__}", daemon=True).start()
    return future


def serve_api_server(args: argparse.Namespace, sock, settings, index: int, link: tuple[str, str],
                     api_servers_serving, slot=None) -> int:
    """API server `index` (>= 1), in a process forked from server 0: the same settings and
    socket, its own link to server 0's worker, its count of open connections in `slot`
    (gateway/http/shared_accept.py); it listens once `api_servers_serving()` returns (server 0 serves)."""
    from spillway.gateway.http.app import build_app

    # Its progress lines ("waiting for the worker", "worker ready") would repeat server 0's.
    logger.setLevel(logging.WARNING)
    try:
        settings = dataclasses.replace(settings, worker_link=link, api_server_index=index,
                                       serve_after=api_servers_serving)
        server = SharedSocketServer(uvicorn_config(args, build_app(settings)), slot=slot)
        server.run(sockets=[sock])
    except (KeyboardInterrupt, Stopped):
        return 0
    return 0 if server.started else 1


def uvicorn_config(args: argparse.Namespace, app) -> uvicorn.Config:
    """The server's uvicorn configuration, from `spillway serve`'s flags."""
    from spillway.gateway.http.http_protocol import server_config

    return server_config(app, host=args.host, port=args.port, loop="uvloop" if _has_uvloop() else "asyncio",
                         log_level=args.uvicorn_log_level, timeout_graceful_shutdown=5,
                         timeout_keep_alive=args.timeout_keep_alive, timeout_request_head=args.timeout_request_head,
                         timeout_request_body=args.timeout_request_body)


def local_replicas(placement):
    """Start every worker of a placement (gateway/replicas/placement.py: replicas, or prefill and
    decode workers) where it puts them (one after another where they share a GPU, else together)
    and wait until all are ready; returns their `start_worker`s, in its order."""
    from concurrent.futures import ThreadPoolExecutor

    logger.info("%s", placement.describe)
    if placement.sequential:
        return [local_workers(launch.config, env=launch.env, log_prefix=f"{launch.name}: ")
                for launch in placement.launches]
    with ThreadPoolExecutor(len(placement.launches)) as pool:
        futures = [pool.submit(local_workers, launch.config, None, launch.env, f"{launch.name}: ")
                   for launch in placement.launches]
        return [future.result() for future in futures]


def local_workers(config, extra_links: list[tuple[str, str]] | None = None, env: dict[str, str] | None = None,
                  log_prefix: str = ""):
    """Start a worker (serving the other API servers' `extra_links` too) and wait until it is
    ready (WorkerStartError if it cannot start); returns the app's `start_worker`, which hands
    out that worker first, then new ones."""
    worker = WorkerProcess(config, extra_links=extra_links, env=env)
    started = time.monotonic()
    last_report = started

    def on_wait() -> None:
        nonlocal last_report
        if time.monotonic() - last_report >= 5.0:
            last_report = time.monotonic()
            logger.info("%swaiting for the worker to load the model (%.0f s)", log_prefix, last_report - started)

    try:
        worker.wait_ready(on_wait=on_wait)
    except BaseException:
        worker.close()
        raise
    started_workers = [worker]
    return lambda: started_workers.pop() if started_workers else WorkerProcess(config, extra_links=extra_links,
                                                                               env=env)


def _has_uvloop() -> bool:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return False
    return True
