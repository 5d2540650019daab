"""The unified token-budget scheduler.

One rule covers prefill, chunked prefill, decode and recompute: a request's
`num_computed_tokens` chases its `num_tokens`. Each step hands out tokens to compute under
`max_num_batched_tokens` and `max_num_seqs`:

    1. running requests, oldest first: 1 token for a decode, the next chunk for a prefill
    2. waiting requests, in queue order: a prefill chunk after the prefix-cache hits, cut to
       the budget that is left (chunked prefill)

Both queues are ordered by (priority, arrival_index): FCFS when no priority is given, and a
preempted request goes back ahead of every younger waiting one. When a running request
needs a block and none is free, the newest running request is preempted: its blocks are
released into the prefix cache, whose evictions write them back to the CPU tier when there
is one (a swap-out); resumed, it takes them back as cache hits (loaded from the CPU tier
where needed) and recomputes only the rest.

The choices of one client request (`n` of them, `Request.parent_id`) share the pool and the
step with other clients' requests (worker/core/fair_share.py): the newest choice of the client
request holding the most is preempted first, a waiting request of one holding fewer is admitted
first, and a client request's choices beyond its share of the step's budget are planned after
admission. With one choice per client request, all of this is the order above.

With a CPU tier, a request whose prefix hits need a load (planned this step, its own or
another's: one load per block, shared; or on its way from an earlier step) is admitted without
a chunk and computes from the first step after the load batch it waits for (its blocks' last)
has landed (`loads_landed`, which the engine calls when the device says so: batches land in
order, each on its own). The requests behind it are not held up, a request whose blocks landed
does not wait for loads planned after them, and the host never waits for a load: it goes on
taking requests in meanwhile.
"""

from __future__ import annotations

from bisect import insort
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence

from spillway.protocol.messages import BlockHash
from spillway.worker.core.admission import Admission, AdmissionCounts, queue_key
from spillway.worker.core.block_manager import BlockManager
from spillway.worker.core.fair_share import FairShare
from spillway.worker.core.request import Request, RequestStatus, finished_status, refusal
from spillway.worker.core.step_commits import StepCommits, mark_in_flight
from spillway.worker.core.step_draft import StepDraft
from spillway.worker.core.step_plan import ScheduledChunk, StepPlan, StepResult

__all__ = ["Scheduler", "ScheduledChunk", "StepPlan", "StepResult"]


def _may_run_ahead(chunks: list[ScheduledChunk]) -> tuple[bool, bool]:
    """(`StepPlan.run_ahead`, `StepPlan.samples_after_commit`): every token the step samples is
    chosen by the device alone (decodes, and prompts whose last chunk runs), some of them under a
    grammar's mask; chunks that sample nothing (a prompt's earlier chunks) never hold a plan back."""
    after_commit = False
    for chunk in chunks:  # a plain loop: this runs every step, over every chunk
        if not chunk.sample:
            continue
        request = chunk.request
        min_tokens = request.params.min_tokens
        if min_tokens and request.num_output_tokens < min_tokens:
            return False, False
        if not request.samples_on_device:
            if not request.samples_after_commit:
                return False, False
            after_commit = True
    return bool(chunks), after_commit


class Scheduler:
    """Turns the request queues into one `StepPlan` per step; see the module doc.

    Usage per step: `plan = schedule()`, run the model on `plan.chunks`, then
    `update(plan, sampled)` with the token sampled for every chunk whose `sample` is set.
    Admission and preemption are its `Admission`'s, the commit of tokens its `StepCommits`';
    it holds the requests, the queues they share, and the release of finished requests.

    `defer_release` (the worker's busy loop): a finished request's blocks are freed by
    `release_finished`, called once its last delta is on its way, so that a step that finishes
    many long requests (a 10k-token prompt's blocks take ~30-60 us to free) does not hold back
    their last tokens. The next schedule frees them first in any case.
    """

    def __init__(
        self,
        block_manager: BlockManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        block_size: int,
        root_hash: BlockHash,
        eos_token_ids: Iterable[int],
        vocab_size: int | None = None,
        write_ahead_blocks: int = 0,
        defer_release: bool = False,
    ) -> None:
        if block_size != block_manager.block_size:
            raise ValueError(f"block size {block_size} differs from {block_manager.block_size}")
        if min(max_num_seqs, max_num_batched_tokens, max_model_len) <= 0:
            raise ValueError("max_num_seqs, max_num_batched_tokens, max_model_len must be positive")
        if -(-max_model_len // block_size) > block_manager.num_gpu_blocks:
            # Otherwise one long request could never fit and would preempt itself forever.
            raise ValueError(f"{block_manager.num_gpu_blocks} blocks of {block_size} tokens "
                             f"cannot hold one request of max_model_len {max_model_len}")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.vocab_size = vocab_size  # None: prompt token ids are not range-checked
        self.defer_release = defer_release
        # Both sorted by queue_key (the newest running request is last); shared with the
        # admission, which changes them in place.
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self._requests: dict[str, Request] = {}
        self._parent_sizes: Counter[str] = Counter()  # unfinished choices per client request
        self.last_received = 0.0  # the newest request's arrival, on the monotonic clock
        # Running requests admitted on prefix blocks whose load has not landed, with the load
        # batch they wait for (`loads_landed`); shared with the admission, changed in place.
        self._awaiting_load: dict[str, int] = {}
        self._finished_holding: list[str] = []  # with defer_release: finished, blocks not freed yet
        # With a CPU tier: cached GPU blocks written back ahead of eviction per step (the
        # engine sizes it; BlockManager.write_back_ahead), looked for 4x as deep in the LRU.
        self.write_ahead_blocks = write_ahead_blocks
        self._admission = Admission(block_manager, self.waiting, self.running, self._awaiting_load, max_num_seqs)
        self._commits = StepCommits(block_manager, max_model_len, root_hash, frozenset(eos_token_ids))

    @property
    def counts(self) -> AdmissionCounts:
        """Cumulative prefix-cache hits and preemptions (`AdmissionCounts`)."""
        return self._admission.counts

    @property
    def has_unfinished(self) -> bool:
        return bool(self._requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_awaiting_load(self) -> int:
        """Running requests admitted on prefix blocks whose load has not landed yet."""
        return len(self._awaiting_load)

    @property
    def first_awaited_load(self) -> int | None:
        """The earliest load batch a running request waits for (None: none waits)."""
        return min(self._awaiting_load.values(), default=None)

    def request_ids(self) -> list[str]:
        """Every unfinished request's id, waiting or running."""
        return list(self._requests)

    def has_request(self, request_id: str) -> bool:
        """Whether the id belongs to an unfinished request (waiting or running)."""
        return request_id in self._requests

    def add(self, request: Request) -> None:
        """Queue a new request. Raises ValueError, queueing nothing, for a request it refuses."""
        problem = refusal(request, max_model_len=self.max_model_len, block_size=self.block_size,
                          vocab_size=self.vocab_size, in_use=request.request_id in self._requests)
        if problem is not None:
            raise ValueError(problem)
        if self._finished_holding:  # the id may be a finished request's whose blocks are still held
            self.release_finished()
        if self.block_manager.enable_prefix_caching:
            self.hash_prompt(request)
        insort(self.waiting, request, key=queue_key)
        self._requests[request.request_id] = request
        self._parent_sizes[request.parent_id] += 1
        self.last_received = max(self.last_received, request.received)

    def hash_prompt(self, request: Request) -> None:
        """Extend the request's block hashes over its full blocks, where the sender did not hash
        them all (the same chain: protocol/hashing.py)."""
        self._commits.hash_full_blocks(request)

    def abort(self, request_ids: Iterable[str]) -> list[Request]:
        """Finish the known ones among `request_ids` as aborted, releasing their blocks now."""
        aborted = []
        for request_id in request_ids:
            request = self._requests.get(request_id)
            if request is None:
                continue
            queue = self.running if request.status == RequestStatus.RUNNING else self.waiting
            queue.remove(request)
            self._release(request, RequestStatus.FINISHED_ABORTED)
            aborted.append(request)
        return aborted

    def schedule(self, ahead: bool = False, lookahead: int = 0, before_landing: bool = False) -> StepPlan:
        """The next step. `ahead`: the step before is still running (`mark_in_flight`), so its
        tokens are counted but unknown: requests whose pending token is surely their last are
        left out, and a running request short of blocks preempts as in any step (the victim's
        pending token is still committed when its step is: `StepCommits.commit`); only
        admission never preempts then.
        `lookahead`: KV slots to reserve after each one-token decode for draft tokens
        (speculative decoding; never with `ahead`), where blocks are free without preempting.
        `before_landing`: the running requests that wait for CPU-tier loads are planned too,
        and the step's forward waits for every load queued (the engine asks for it when
        nothing else runs and the loads are about to land: worker/driver/tier_driver.py), as are
        requests admitted now on those loads. Client requests share the step (FairShare):
        choices of one beyond its share of the step are planned after admission."""
        assert not (ahead and lookahead), "draft tokens need every token of the step before"
        if self._finished_holding:
            self.release_finished()
        budget = self.max_num_batched_tokens
        step = StepDraft(budget, FairShare.of(self.running, self._parent_sizes, budget))
        # Before the landing, a request arriving now on blocks of those loads (a burst's late
        # member) joins the step too: it waits for nothing the step does not wait for already.
        join_through = max(self._awaiting_load.values(), default=0) if before_landing else 0
        deferred = self._plan_running(list(self.running), step, ahead, before_landing)
        if lookahead:  # after every running request has its blocks: drafts never cause a preemption
            self._reserve_draft_slots(list(step.chunks.values()), lookahead, step)
        self._admission.admit_waiting(step, join_through, ahead)
        if step.budget > 0 and step.share.held_back:  # what the shares left, to whoever is next
            step.share.lift_caps()
            self._plan_running(deferred, step, ahead, before_landing)
            if lookahead:
                self._reserve_draft_slots([step.chunks[r.request_id] for r in deferred if r.request_id in step.chunks],
                                          lookahead, step)
            self._admission.admit_waiting(step, join_through, ahead)
        if self.write_ahead_blocks:
            self.block_manager.write_back_ahead(self.write_ahead_blocks, 4 * self.write_ahead_blocks)
        chunks = list(step.chunks.values())
        run_ahead, after_commit = _may_run_ahead(chunks)
        return StepPlan(chunks, self.max_num_batched_tokens - step.budget, run_ahead,
                        self.block_manager.take_copies(), after_commit)

    def mark_in_flight(self, plan: StepPlan) -> None:
        """`plan` runs on the device and its tokens are not read yet (step_commits.mark_in_flight):
        `schedule(ahead=True)` plans the step after it, `update(plan, ...)` settles it."""
        mark_in_flight(plan)

    def update(self, plan: StepPlan, sampled: dict[str, int],
               accepted: Mapping[str, Sequence[int]] | None = None) -> list[StepResult]:
        """Apply a computed plan (`StepCommits.commit`: `sampled` maps request id -> token for
        chunks with `sample`, `accepted` the drafts accepted before it) and finish the requests
        it ends: their blocks are released now, or with `defer_release` by `release_finished`."""
        results = self._commits.commit(plan, sampled, accepted)
        finished = [result for result in results if result.finish_reason is not None]
        preempted = False
        for result in finished:
            preempted |= result.request.status == RequestStatus.PREEMPTED  # its last token was in flight
            self._release(result.request, finished_status(result.finish_reason), defer=self.defer_release)
        if finished:
            self.running[:] = [request for request in self.running if not request.is_finished]
        if preempted:
            self.waiting[:] = [request for request in self.waiting if not request.is_finished]
        return results

    def release_finished(self) -> None:
        """Free the blocks of the requests finished with `defer_release` set."""
        for request_id in self._finished_holding:
            self.block_manager.free(request_id)
        self._finished_holding.clear()

    def loads_landed(self, through: int | None = None) -> None:
        """The CPU tier's load batches up to `through` (all taken so far when None) are on the
        GPU: the requests that waited for them compute from this step on."""
        self.block_manager.loads_landed(through)
        if through is None:
            self._awaiting_load.clear()
            return
        for request_id in [request_id for request_id, batch in self._awaiting_load.items() if batch <= through]:
            del self._awaiting_load[request_id]

    def _plan_running(self, requests: list[Request], step: StepDraft, ahead: bool,
                      before_landing: bool) -> list[Request]:
        """Chunks for running requests, oldest first: 1 token for a decode, the next chunk of
        a prefill, under the budget. A choice whose client request has had its share of the
        step is left out and returned (deferred: FairShare.cap)."""
        deferred = []
        for request in requests:
            if step.budget <= 0:
                break
            if request.status != RequestStatus.RUNNING:
                continue  # preempted by a request before it in this step
            if ahead and request.num_pending_tokens and self._last_token_is_pending(request):
                continue
            awaiting = request.request_id in self._awaiting_load
            if awaiting and not before_landing:
                continue  # admitted on blocks still landing: computes once they have, holding up nobody
            num_tokens = min(request.num_tokens + request.num_pending_tokens - request.num_computed_tokens,
                             step.budget)
            num_tokens = step.share.cap(request, num_tokens)
            if not num_tokens:
                deferred.append(request)
                continue
            if awaiting:
                del self._awaiting_load[request.request_id]
                self.block_manager.wait_for_loads_this_step()
            if not self._admission.allocate_or_preempt(request, num_tokens, step):
                continue  # the request was the one to go
            step.plan(request, num_tokens, self.block_manager.slot_table(request.request_id))
        return deferred

    def _last_token_is_pending(self, request: Request) -> bool:
        """Whether the pending token ends the request by length, whatever it is."""
        return (request.num_output_tokens + 1 >= request.params.max_tokens
                or request.num_tokens + 1 >= self.max_model_len)

    def _reserve_draft_slots(self, chunks: list[ScheduledChunk], lookahead: int, step: StepDraft) -> None:
        """Slots for up to `lookahead` drafts after each one-token decode, from free blocks and
        the token budget left, cut so that a fully accepted run (drafts and the token after
        them) stays within max_tokens and max_model_len."""
        for chunk in chunks:
            request = chunk.request
            if not (chunk.sample and chunk.num_tokens == 1):
                continue
            room = min(lookahead, step.budget, request.params.max_tokens - request.num_output_tokens - 1,
                       self.max_model_len - request.num_tokens - 1)
            if room > 0 and self.block_manager.allocate(request.request_id, request.num_tokens + room):
                step.reserve_drafts(chunk, room, self.block_manager.slot_table(request.request_id))

    def _release(self, request: Request, status: RequestStatus, defer: bool = False) -> None:
        """Finish the request; its blocks are freed now, or with `defer` by `release_finished`."""
        self._awaiting_load.pop(request.request_id, None)
        request.status = status
        if defer:
            self._finished_holding.append(request.request_id)
        else:
            self.block_manager.free(request.request_id)
        del self._requests[request.request_id]
        sizes = self._parent_sizes
        sizes[request.parent_id] -= 1
        if not sizes[request.parent_id]:
            del sizes[request.parent_id]  # the share of the step goes to the client requests still held
