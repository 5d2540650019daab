"""`spillway serve`'s server over a fake worker (tests/gateway/fake_worker.py): its flags, its
uvicorn configuration (gateway/http/serve_run.py `uvicorn_config`) and its accepting server
(`BannerServer`), in a thread of the test (`serving`) or as a process of its own
(`FakeServeProcess`, `python fake_serve.py PORT FLAGS...`), without loading a model."""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from pathlib import Path


from ports import HOST, listening_socket
from server_helpers import MODEL, ServerProcess, fake_app, running_in_thread
from spillway.gateway.cli.serve_args import build_parser
from spillway.gateway.http.serve_run import BannerServer, bind_port, uvicorn_config
from spillway.protocol.local import model_files

TESTS = Path(__file__).resolve().parents[1]


def _server(sock, flags: tuple[str, ...], script: list[int], step_s: float) -> BannerServer:
    args = build_parser().parse_args(["serve", "--host", HOST, "--port", str(sock.getsockname()[1]),
                                      "--uvicorn-log-level", "warning", *flags])
    app, _ = fake_app(model_files.resolve_model(None), script, step_s=step_s)
    return BannerServer(uvicorn_config(args, app), MODEL)


@contextmanager
def serving(*flags: str, script: list[int] = (1, 2), step_s: float = 0.002):
    """The server with `flags` in a thread of this process; its (host, port)."""
    sock = listening_socket()
    with running_in_thread(_server(sock, flags, list(script), step_s), sock):
        yield sock.getsockname()


def FakeServeProcess(*flags: str, preexec_fn=None) -> ServerProcess:
    """The server as a process of its own on a reserved port (`python fake_serve.py PORT FLAGS...`);
    `preexec_fn` runs in it before anything (a lower file-handle limit, say)."""
    path = [str(TESTS), str(TESTS / "gateway"), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    return ServerProcess(*flags, command=lambda port: [sys.executable, __file__, str(port)], env=env,
                         preexec_fn=preexec_fn)


def main(port: int, flags: list[str]) -> None:
    sock = bind_port(HOST, port)
    try:
        _server(sock, tuple(flags), [1, 2], 0.002).run(sockets=[sock])
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2:])
