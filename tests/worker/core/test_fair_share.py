"""FairShare on its own: which choice is preempted, which waiting request comes in next, and
how much of a step a client request of several choices plans before the others' turn."""

from __future__ import annotations

from collections import Counter

from spillway.protocol.messages import SamplingParams
from spillway.worker.core.fair_share import FairShare
from spillway.worker.core.request import Request


def choice(request_id: str, parent: str = "", arrival: int = 0, priority: int = 0) -> Request:
    return Request(request_id=request_id, prompt=[1, 2, 3], params=SamplingParams(max_tokens=4), block_hashes=[],
                   arrival_index=arrival, priority=priority, parent_id=parent)


def share_of(running: list[Request], waiting: list[Request] = (), budget: int = 64) -> FairShare:
    sizes = Counter(request.parent_id for request in [*running, *waiting])
    return FairShare.of(running, sizes, budget)


def test_the_victim_is_the_newest_choice_of_the_parent_running_the_most():
    running = [choice("a-0", "a", 1), choice("b-0", "b", 2), choice("b-1", "b", 3), choice("c", arrival=4)]
    share = share_of(running)
    assert share.victim(running) == 2  # b-1: b runs two, its newest; c is newer but runs one
    share.preempted(running.pop(2))
    assert share.victim(running) == 2  # every parent runs one now: the newest, c
    assert share.holding == Counter(a=1, b=1, c=1)


def test_with_one_choice_per_request_the_victim_is_the_newest():
    running = [choice("a", arrival=1), choice("b", arrival=2), choice("c", arrival=3)]
    assert share_of(running).victim(running) == 2


def test_a_waiting_request_of_a_parent_running_fewer_is_admitted_first_within_its_priority():
    running = [choice("hog-0", "hog", 1), choice("hog-1", "hog", 2)]
    waiting = [choice("urgent", arrival=9, priority=-1), choice("hog-2", "hog", 3), choice("short", arrival=8),
               choice("late", arrival=10)]
    share = share_of(running, waiting)
    assert share.next_admission(waiting) == 0  # priority first: urgent
    waiting.pop(0)
    assert share.next_admission(waiting) == 1  # short: its parent runs none, hog's runs two
    share.admitted(waiting.pop(1))
    assert share.next_admission(waiting) == 1  # late (runs none) before hog-2
    assert share.next_admission([choice("hog-3", "hog", 4), choice("lower", arrival=5, priority=1)]) == 0


def test_after_a_preemption_only_an_admission_that_evens_the_holdings_out_comes_in():
    running = [choice(f"hog-{i}", "hog", i) for i in range(3)] + [choice("mid-0", "mid", 5)]
    share = share_of(running, [choice("x", arrival=9)])
    share.preempted(running.pop(2))  # hog ran 3
    assert share.next_admission([choice("hog-2", "hog", 2)]) is None  # 2 + 1 is not below 3
    assert share.next_admission([choice("mid-1", "mid", 6)]) == 0  # 1 + 1 is
    assert share.evens_out(running[0], choice("x", arrival=9))  # hog runs 2, x's parent none
    assert not share.evens_out(running[2], choice("x", arrival=9))  # mid runs 1


def test_a_parent_of_several_choices_plans_its_share_of_the_step_before_the_others_turn():
    hog = [choice(f"hog-{i}", "hog", i) for i in range(3)]
    single = choice("single", arrival=5)
    share = share_of(hog + [single], budget=64)  # two parents: 32 tokens each
    assert share.step_share == 32
    assert share.cap(hog[0], 20) == 20
    share.planned(hog[0], 20)
    assert share.cap(hog[1], 20) == 12  # cut to what is left of its share
    share.planned(hog[1], 12)
    assert share.cap(hog[2], 1) == 0 and share.held_back
    assert share.cap(single, 60) == 60  # one choice: planned as any request, whole
    share.lift_caps()
    assert share.cap(hog[2], 40) == 40
