"""A fair share of the KV pool and of each step between client requests.

A client request (`Request.parent_id`: every choice of one HTTP request with `n` choices, of
every prompt) reaches the scheduler as one `Request` per choice. Left to queue order alone, a
request with n=64 on a long prompt holds every sequence slot and block, and a short request
of another client is the newest: it is the one preempted, and it waits behind the large one's
preempted choices. `FairShare` is what one step of planning knows of the client requests:

    holding     parent -> its running choices, kept as the step admits and preempts
    sizes       parent -> its unfinished choices, waiting or running (the scheduler's count)
    preemption  the newest choice of the parent holding the most (among equals, the newest
                running choice: with one choice per parent, the newest request, as before)
    admission   by priority, then the fewest running choices of its parent, then arrival; once
                the step has preempted, only a request whose admission evens the holdings out
                (its parent holding at least two fewer than the preempted one held); with
                every sequence slot taken, such a request takes the slot of the newest choice
                of the parent holding the most
    the step    a parent of several choices plans at most `step_share` tokens (the budget
                split evenly between the parents the scheduler holds) before every other
                parent has had its turn: its further running choices are deferred until after
                admission, and its waiting ones wait for a later step (`cap`)

A parent with one choice is planned as any request always was: one chunk, in queue order.
"""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass, field

from spillway.worker.core.request import Request


@dataclass(slots=True)
class FairShare:
    """One step's view of the client requests' holdings (module doc)."""

    holding: Counter[str]
    sizes: Counter[str]
    # Tokens of the step a parent of several choices takes before the others' turn.
    step_share: int
    used: dict[str, int] = field(default_factory=dict)  # tokens planned this step, per such parent
    # The fewest running choices a parent preempted this step held before it was (none: maxsize).
    preempted_holding: int = sys.maxsize
    held_back: bool = False  # whether `cap` has held something back this step
    # Cleared (`lift_caps`) once every parent has had its turn: what the step has left goes to
    # whoever is next.
    capped: bool = True

    @classmethod
    def of(cls, running: list[Request], sizes: Counter[str], budget: int) -> FairShare:
        """The running choices counted; the step's budget split between every parent held."""
        holding = Counter(request.parent_id for request in running)
        return cls(holding, sizes, -(-budget // max(len(sizes), 1)))

    def cap(self, request: Request, num_tokens: int) -> int:
        """The tokens of `num_tokens` the request plans before every parent has had its turn
        (0: it waits for the deferred pass)."""
        parent = request.parent_id
        if not self.capped or self.sizes[parent] < 2:
            return num_tokens
        allowed = max(min(num_tokens, self.step_share - self.used.get(parent, 0)), 0)
        self.held_back |= allowed < num_tokens
        return allowed

    def lift_caps(self) -> None:
        """Every parent has had its turn: `cap` holds nothing back from now on."""
        self.capped = False

    def planned(self, request: Request, num_tokens: int) -> None:
        parent = request.parent_id
        if self.sizes[parent] >= 2:
            self.used[parent] = self.used.get(parent, 0) + num_tokens

    def victim(self, running: list[Request]) -> int:
        """The index in `running` of the choice to preempt: the newest of the parent holding
        the most."""
        best = len(running) - 1
        most = self.holding[running[best].parent_id]
        for index in range(best - 1, -1, -1):  # a parent's newest choice comes first
            count = self.holding[running[index].parent_id]
            if count > most:
                best, most = index, count
        return best

    def preempted(self, request: Request) -> None:
        before = self.holding[request.parent_id]
        self.preempted_holding = min(self.preempted_holding, before)
        self.holding[request.parent_id] = before - 1

    def next_admission(self, waiting: list[Request]) -> int | None:
        """The index in `waiting` (sorted by priority, then arrival) of the request to admit
        next, or None when, after this step's preemptions, admitting it would not even the
        holdings out (it would only be preempted again)."""
        best_index, best = 0, waiting[0]
        fewest = self.holding[best.parent_id]
        index = 1
        while fewest and index < len(waiting) and waiting[index].priority == best.priority:
            count = self.holding[waiting[index].parent_id]
            if count < fewest:
                best_index, fewest = index, count
            index += 1
        if fewest + 1 >= self.preempted_holding:
            return None
        return best_index

    def evens_out(self, victim: Request, request: Request) -> bool:
        """Whether `request` taking `victim`'s place leaves the two parents' holdings closer."""
        return self.holding[victim.parent_id] >= self.holding[request.parent_id] + 2

    def admitted(self, request: Request) -> None:
        self.holding[request.parent_id] += 1
