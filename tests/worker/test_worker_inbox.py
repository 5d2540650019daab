"""The worker's inbox: a burst of messages is taken in a slice at a time while there is work."""

from __future__ import annotations

import pytest
import zmq

from spillway.worker.main import take_messages


@pytest.fixture
def inbox():
    """(push, pull, poller): the worker's inbox over inproc sockets."""
    ctx = zmq.Context()
    try:
        push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
        pull.bind("inproc://inbox")
        push.connect("inproc://inbox")
        poller = zmq.Poller()
        poller.register(pull, zmq.POLLIN)
        yield push, pull, poller
    finally:
        ctx.destroy(linger=0)


def test_a_busy_worker_takes_a_burst_in_slices_and_an_idle_one_takes_it_all(inbox):
    push, pull, poller = inbox
    for i in range(50):
        push.send(b"%d" % i)
    # Busy, no time to spare: one message per iteration, in order, none lost.
    assert list(take_messages(poller, pull, 1000, lambda: True, budget_s=0.0)) == [b"0"]
    assert list(take_messages(poller, pull, 1000, lambda: True, budget_s=0.0)) == [b"1"]
    # Idle: the whole queue at once, whatever the budget.
    assert list(take_messages(poller, pull, 1000, lambda: False, budget_s=0.0)) == [b"%d" % i for i in range(2, 50)]
    assert list(take_messages(poller, pull, 0, lambda: False)) == []  # nothing waiting, no wait


def test_a_landing_ends_the_intake_before_the_budget_does(inbox):
    """While nothing computes before a load lands, the inbox is taken for a long budget, but
    once `ready()` says a load landed the step runs: the rest waits for the next iteration."""
    push, pull, poller = inbox
    for i in range(10):
        push.send(b"%d" % i)
    taken = []

    def ready() -> bool:
        return len(taken) >= 3  # the load lands once three messages are in

    for data in take_messages(poller, pull, 1000, lambda: True, budget_s=60.0, ready=ready):
        taken.append(data)
    assert taken == [b"0", b"1", b"2"]
    # The next iteration takes the rest, in order; an idle worker ignores `ready`.
    assert list(take_messages(poller, pull, 1000, lambda: False, budget_s=60.0, ready=lambda: True)) == \
        [b"%d" % i for i in range(3, 10)]
