"""The worker's inbox: a burst of messages is taken in a slice at a time while there is work."""

from __future__ import annotations

import zmq

from spillway.worker.main import take_messages


def test_a_busy_worker_takes_a_burst_in_slices_and_an_idle_one_takes_it_all():
    ctx = zmq.Context()
    try:
        push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
        pull.bind("inproc://inbox")
        push.connect("inproc://inbox")
        poller = zmq.Poller()
        poller.register(pull, zmq.POLLIN)
        for i in range(50):
            push.send(b"%d" % i)
        # Busy, no time to spare: one message per iteration, in order, none lost.
        assert list(take_messages(poller, pull, 1000, lambda: True, budget_s=0.0)) == [b"0"]
        assert list(take_messages(poller, pull, 1000, lambda: True, budget_s=0.0)) == [b"1"]
        # Idle: the whole queue at once, whatever the budget.
        assert list(take_messages(poller, pull, 1000, lambda: False, budget_s=0.0)) == [b"%d" % i for i in range(2, 50)]
        assert list(take_messages(poller, pull, 0, lambda: False)) == []  # nothing waiting, no wait
    finally:
        ctx.destroy(linger=0)
