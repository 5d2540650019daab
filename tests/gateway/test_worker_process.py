"""The local worker process: closing it never hangs, even when the worker has gone."""

from __future__ import annotations

import threading

from spillway.gateway.worker_process import WorkerProcess
from spillway.worker.config import WorkerConfig


class ExitingProcess:
    """Looks alive to `close()`, as a worker does between its error message and its exit."""

    def is_alive(self) -> bool:
        return True

    def join(self, timeout: float | None = None) -> None:
        pass

    def terminate(self) -> None:
        pass


def test_closing_does_not_hang_when_the_worker_has_gone():
    worker = WorkerProcess(WorkerConfig(model="/no/such/model", device="cpu"))
    worker.process.join(120)  # it cannot start: it reports why and exits, its sockets with it
    assert worker.process.exitcode is not None
    worker.process = ExitingProcess()
    closing = threading.Thread(target=worker.close, daemon=True)
    closing.start()
    closing.join(10)
    assert not closing.is_alive(), "close() blocked sending to a worker that had gone"
