"""The worker's inboxes: a burst of messages is taken in a slice at a time while there is work;
with several links (API servers), each request's outputs go back to the link it came from."""

from __future__ import annotations

import pytest
import zmq

from spillway.protocol.messages import FinishReason, RequestDelta
from spillway.worker.gateway_links import GatewayLinks, take_messages


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
    assert list(take_messages(poller, [pull], 1000, lambda: True, budget_s=0.0)) == [(0, b"0")]
    assert list(take_messages(poller, [pull], 1000, lambda: True, budget_s=0.0)) == [(0, b"1")]
    # Idle: the whole queue at once, whatever the budget.
    assert list(take_messages(poller, [pull], 1000, lambda: False, budget_s=0.0)) == [(0, b"%d" % i) for i in range(2, 50)]
    assert list(take_messages(poller, [pull], 0, lambda: False, budget_s=0.0)) == []  # nothing waiting, no wait


def test_a_landing_ends_the_intake_before_the_budget_does(inbox):
    """While nothing computes before a load lands, the inbox is taken for a long budget, but
    once `ready()` says a load landed the step runs: the rest waits for the next iteration."""
    push, pull, poller = inbox
    for i in range(10):
        push.send(b"%d" % i)
    taken = []

    def ready() -> bool:
        return len(taken) >= 3  # the load lands once three messages are in

    for _, data in take_messages(poller, [pull], 1000, lambda: True, budget_s=60.0, ready=ready):
        taken.append(data)
    assert taken == [b"0", b"1", b"2"]
    # The next iteration takes the rest, in order; an idle worker ignores `ready`.
    assert list(take_messages(poller, [pull], 1000, lambda: False, budget_s=60.0, ready=lambda: True)) == \
        [(0, b"%d" % i) for i in range(3, 10)]


def test_each_request_goes_back_to_its_link_and_a_new_session_forgets_only_its_own(tmp_path):
    """Two API servers: messages from both are taken, in turn; deltas are routed to the link
    whose Generate brought the request, a finished request is forgotten, and the requests of a
    link whose gateway is new are handed back to be aborted, the other link's kept."""
    ctx = zmq.Context()
    try:
        gateways = []
        addresses = []
        for k in range(2):
            inbox, outbox = f"ipc://{tmp_path}/in{k}", f"ipc://{tmp_path}/out{k}"
            push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
            push.bind(inbox)
            pull.bind(outbox)
            gateways.append((push, pull))
            addresses.append((inbox, outbox))
        links = GatewayLinks(ctx, addresses)
        assert len(links) == 2
        gateways[0][0].send(b"a")
        gateways[1][0].send(b"b")
        gateways[1][0].send(b"c")
        taken = []
        while len(taken) < 3:
            taken += list(links.take(1000, lambda: False, 0.0))
        assert sorted(taken) == [(0, b"a"), (1, b"b"), (1, b"c")]
        links.admit("r0", 0)
        links.admit("r1", 1)
        links.admit("r2", 1)
        step = [RequestDelta(request_id="r1", new_token_ids=[5]), RequestDelta(request_id="r0", new_token_ids=[6]),
                RequestDelta(request_id="r2", new_token_ids=[7], finish_reason=FinishReason.STOP)]
        to0, to1 = links.route(step)
        assert [d.request_id for d in to0] == ["r0"]
        assert [d.request_id for d in to1] == ["r1", "r2"]
        assert links.forget(1) == ["r1"]  # r2 finished: forgotten already
        assert links.forget(1) == []
        assert [d.request_id for d in links.route([RequestDelta(request_id="r0", new_token_ids=[1])])[0]] == ["r0"]
        links.send_all(b"hi")
        assert [pull.recv() for _, pull in gateways] == [b"hi", b"hi"]
    finally:
        ctx.destroy(linger=0)


def test_one_link_routes_everything_to_it_and_keeps_no_owners(tmp_path):
    ctx = zmq.Context()
    try:
        links = GatewayLinks(ctx, [(f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out")])
        links.admit("r0", 0)
        step = [RequestDelta(request_id="r0", new_token_ids=[1]), RequestDelta(request_id="x", new_token_ids=[2])]
        assert links.route(step) == [step]
        assert links.forget(0) == []  # nothing is tracked for a single link
    finally:
        ctx.destroy(linger=0)
