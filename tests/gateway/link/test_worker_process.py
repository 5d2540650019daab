"""The local worker process: closing it never hangs, even when the worker has gone."""

from __future__ import annotations

import threading
import time

from spillway.gateway.link.worker_process import WorkerProcess
from spillway.protocol.config import WorkerConfig


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


def _deltas(worker: WorkerProcess, until, timeout_s: float = 120.0) -> tuple[list, list]:
    """(request deltas, Ready messages) the worker sends until `until(deltas, readies)` holds:
    a condition, not a fixed time, so a slow (loaded) machine only makes the test slower."""
    from spillway.protocol.messages import Ready, StepOutputs

    deltas, readies = [], []
    deadline = time.monotonic() + timeout_s
    while not until(deltas, readies):
        assert time.monotonic() < deadline, (deltas, readies)
        msg = worker.recv(timeout_ms=100)
        if isinstance(msg, StepOutputs):
            deltas.extend(msg.outputs)
        elif isinstance(msg, Ready):
            readies.append(msg)
    return deltas, readies


def test_hello_from_a_new_gateway_gets_ready_again_and_drops_the_old_gateways_requests():
    from spillway.protocol.messages import Control, ControlCommand, Generate, SamplingParams

    def generate(request_id: str, max_tokens: int) -> Generate:
        return Generate(request_id=request_id, prompt_token_ids=[1, 2, 3, 4], block_hashes=[],
                        params=SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))

    worker = WorkerProcess(WorkerConfig(device="cpu", max_model_len=2048))
    try:
        ready = worker.wait_ready(300)
        assert len(ready.worker_session) == 8
        worker.send(generate("old", 1500))
        _deltas(worker, lambda deltas, _: any(d.request_id == "old" and d.new_token_ids for d in deltas))

        worker.send(Control(ControlCommand.HELLO, session=b"gateway2"))
        # Deltas of the step under way when the HELLO came may still arrive; none after the Ready.
        _, readies = _deltas(worker, lambda _, readies: readies)
        assert [r.worker_session for r in readies] == [ready.worker_session]
        worker.send(Control(ControlCommand.HELLO, session=b"gateway2"))  # the same gateway again: no answer
        worker.send(generate("new", 3))
        deltas, readies = _deltas(worker, lambda deltas, _: any(d.request_id == "new" and d.finish_reason
                                                                for d in deltas))
        assert readies == []
        assert not [d for d in deltas if d.request_id == "old"]
        new = [d for d in deltas if d.request_id == "new"]
        assert sum(len(d.new_token_ids) for d in new) == 3 and new[-1].finish_reason is not None
    finally:
        worker.close()
