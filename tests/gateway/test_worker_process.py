"""The local worker process: closing it never hangs, even when the worker has gone."""

from __future__ import annotations

import threading
import time

from spillway.gateway.worker_process import WorkerProcess
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


def _deltas(worker: WorkerProcess, seconds: float) -> tuple[list, list]:
    """(request deltas, Ready messages) the worker sends within `seconds`."""
    from spillway.protocol.messages import Ready, StepOutputs

    deltas, readies = [], []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
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
        deltas, _ = _deltas(worker, 1.0)
        assert any(d.request_id == "old" and d.new_token_ids for d in deltas), "the old request never ran"

        worker.send(Control(ControlCommand.HELLO, session=b"gateway2"))
        deltas, readies = _deltas(worker, 2.0)
        assert [r.worker_session for r in readies] == [ready.worker_session]
        late = [d for d in deltas if d.request_id == "old"]
        # Deltas of the step under way when the HELLO came may still arrive; none after the Ready.
        worker.send(Control(ControlCommand.HELLO, session=b"gateway2"))  # the same gateway again: no answer
        worker.send(generate("new", 3))
        deltas, readies = _deltas(worker, 3.0)
        assert readies == []
        assert not [d for d in deltas if d.request_id == "old"], late
        new = [d for d in deltas if d.request_id == "new"]
        assert sum(len(d.new_token_ids) for d in new) == 3 and new[-1].finish_reason is not None
    finally:
        worker.close()
